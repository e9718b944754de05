package advisory

import "hash/fnv"

// Namespace is the top byte of key1 of every message lock ('L'): key1 lies in
// [0x4C000000, 0x4CFFFFFE].
const Namespace int32 = 0x4C000000

// ProbeKey1 is the key1 of the lock the session check takes and drops at once (with key2 =
// the backend's pid). It lies in the namespace but no message lock ever uses it.
const ProbeKey1 int32 = Namespace | 0x00FFFFFF

// NamespaceFirst and NamespaceLast bound key1 of the library's locks, for queries on pg_locks:
// classid BETWEEN NamespaceFirst AND NamespaceLast AND objsubid = 2.
const (
	NamespaceFirst = uint32(Namespace)
	NamespaceLast  = uint32(ProbeKey1)
)

// Key1 is the first half of the lock keys of the messages of one consumer group: the
// namespace byte over 24 bits of a hash of the quoted, schema-qualified messages table name
// and the group's name.
func Key1(messagesTable, consumerGroup string) int32 {
	h := fnv.New32a()
	h.Write([]byte(messagesTable))
	h.Write([]byte{0})
	h.Write([]byte(consumerGroup))
	s := h.Sum32()
	low := (s ^ s>>24) & 0x00FFFFFF
	if low == 0x00FFFFFF {
		low = 0x00FFFFFE // ProbeKey1 is reserved
	}
	return Namespace | int32(low)
}

// Key2 is the second half of a message's lock key: the low 32 bits of its offset. The SQL of
// this package computes the same value as ("offset"::bit(32))::int4.
func Key2(offset int64) int32 { return int32(uint32(offset)) }
