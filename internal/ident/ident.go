// Package ident validates the untrusted names the library turns into SQL (topics, consumer
// groups, table prefixes, schemas) and builds the quoted table identifiers from them.
//
// A name reaches SQL only after Validate* accepted it, and only quoted: the character set is
// narrow on purpose (so a table name reads the same in psql, logs and migration files), and
// quoting is a second, independent guard.
package ident

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxNameLength is the longest topic or consumer group name accepted, in bytes.
const MaxNameLength = 255

// MaxIdentifierLength is PostgreSQL's limit (NAMEDATALEN-1) on an identifier, in bytes. Longer
// identifiers are silently truncated by the server, which could make two topics share a table:
// the library hashes long names instead.
const MaxIdentifierLength = 63

// NameError says why a name was refused.
type NameError struct {
	Field  string // the config field or argument: "topic", "ConsumerGroup", ...
	Value  string // the refused value, quoted with %q when printed
	Reason string
}

func (e *NameError) Error() string {
	return fmt.Sprintf("invalid %s %q: %s", e.Field, e.Value, e.Reason)
}

func nameCharOK(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' ||
		r == '_' || r == '-' || r == '.' || r == ':' || r == '/' || r == '$'
}

// ValidateName checks a topic or consumer group name: 1 to 255 bytes of ASCII letters, digits
// and _ - . : / $.
//
// They hold every character watermill-sql accepts in its topics (ASCII letters, digits and
// - $ : . _), so that its topics move to this library unchanged, and /; spaces, quotes,
// backslashes, control characters and anything beyond ASCII are refused. Every accepted character stands for itself inside a quoted
// identifier, in PostgreSQL as in SQLite: only the double quote would need escaping there, and
// it is refused. $ starts no parameter and no dollar quote inside quotes; where a name is
// written into a dollar-quoted body, the tag is chosen so that the name cannot spell it. #
// stays refused: the shortened table names of long topics use it (see TableName).
func ValidateName(field, name string) error {
	if name == "" {
		return &NameError{Field: field, Value: name, Reason: "must not be empty"}
	}
	if len(name) > MaxNameLength {
		return &NameError{Field: field, Value: name[:32] + "...", Reason: fmt.Sprintf("is %d bytes long, the limit is %d", len(name), MaxNameLength)}
	}
	if !utf8.ValidString(name) {
		return &NameError{Field: field, Value: name, Reason: "is not valid UTF-8"}
	}
	for i, r := range name {
		if !nameCharOK(r) {
			return &NameError{Field: field, Value: name, Reason: fmt.Sprintf("character %q at byte %d is not allowed (allowed: ASCII letters, digits, _ - . : / $)", r, i)}
		}
	}
	return nil
}

// ValidateIdentifier checks a configured SQL identifier (a schema or table prefix): ASCII
// lower-case letters, digits and _, starting with a letter or _, at most maxLen bytes.
// allowEmpty accepts "" (meaning: not set).
func ValidateIdentifier(field, id string, maxLen int, allowEmpty bool) error {
	if id == "" {
		if allowEmpty {
			return nil
		}
		return &NameError{Field: field, Value: id, Reason: "must not be empty"}
	}
	if len(id) > maxLen {
		return &NameError{Field: field, Value: id, Reason: fmt.Sprintf("is %d bytes long, the limit is %d", len(id), maxLen)}
	}
	for i, r := range id {
		ok := r >= 'a' && r <= 'z' || r == '_' || (i > 0 && r >= '0' && r <= '9')
		if !ok {
			return &NameError{Field: field, Value: id, Reason: fmt.Sprintf("character %q at byte %d is not allowed (allowed: lower-case ASCII letters, digits and _, not starting with a digit)", r, i)}
		}
	}
	return nil
}

// Quote quotes one identifier for PostgreSQL.
func Quote(id string) string {
	return `"` + strings.ReplaceAll(id, `"`, `""`) + `"`
}

// Qualified quotes schema.name, or name alone when schema is "".
func Qualified(schema, name string) string {
	if schema == "" {
		return Quote(name)
	}
	return Quote(schema) + "." + Quote(name)
}

// TableName builds the table name prefix+topic+suffix. When that would pass PostgreSQL's 63-byte
// limit, the topic part is cut and followed by "#" and 12 hex digits of the SHA-256 of the
// whole topic, so distinct topics keep distinct tables: "#" cannot appear in a topic, so a
// short topic can never spell out a long one's shortened name (table names are always quoted).
func TableName(prefix, topic, suffix string) string {
	name := prefix + topic + suffix
	if len(name) <= MaxIdentifierLength {
		return name
	}
	sum := sha256.Sum256([]byte(topic))
	hash := hex.EncodeToString(sum[:])[:12]
	keep := MaxIdentifierLength - len(prefix) - len(suffix) - len(hash) - 1
	if keep < 0 {
		keep = 0
	}
	return prefix + topic[:keep] + "#" + hash + suffix
}

// SQLiteTableName is TableName for a SQLite database, which compares table names without
// regard to case, quoted or not: "Orders" and "orders" would name one table. A topic with an
// upper-case letter therefore gets "#" and 12 hex digits of the SHA-256 of the whole topic
// after its (possibly cut) name, the shape of a shortened name, so its tables are its own:
// two such names equal without regard to case hold the same hash, and a name without "#" is
// an all-lower-case topic's, unshortened, which no other topic gets. An all-lower-case topic
// keeps TableName's name, as in files written before.
func SQLiteTableName(prefix, topic, suffix string) string {
	if strings.ToLower(topic) == topic {
		return TableName(prefix, topic, suffix)
	}
	sum := sha256.Sum256([]byte(topic))
	hash := hex.EncodeToString(sum[:])[:12]
	keep := min(len(topic), max(MaxIdentifierLength-len(prefix)-len(suffix)-len(hash)-1, 0))
	return prefix + topic[:keep] + "#" + hash + suffix
}
