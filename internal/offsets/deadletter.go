package offsets

import (
	"context"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Metadata keys of a message moved to a dead-letter topic.
const (
	MetaDeadLetterTopic    = "sqlbroker_dead_letter_topic"    // the topic it was moved from
	MetaDeadLetterGroup    = "sqlbroker_dead_letter_group"    // the consumer group that gave up on it
	MetaDeadLetterAttempts = "sqlbroker_dead_letter_attempts" // its attempts in that group
	MetaDeadLetterOffset   = "sqlbroker_dead_letter_offset"   // its offset in that topic
)

// DeadLetter moves the fenced claims fs of the group (named group) to the messages table of
// to, another topic's store, and returns the offsets it moved; the others were stale, as for
// Ack. dropKeys are the two metadata keys (attempt, offset) the copy leaves out. The claim is
// deleted and a copy of its message, with the topic, the group, its attempts and its offset
// added to its metadata, is inserted there: both or neither.
func (s *Store) DeadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to *Store, dropKeys [2]string) (map[int64]bool, error) {
	return s.db.deadLetter(ctx, q, groupID, group, fs, to.T, dropKeys)
}
