package offsets

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Metadata keys of a message moved to a dead-letter topic.
const (
	MetaDeadLetterTopic    = "sqlbroker_dead_letter_topic"    // the topic it was moved from
	MetaDeadLetterGroup    = "sqlbroker_dead_letter_group"    // the consumer group that gave up on it
	MetaDeadLetterAttempts = "sqlbroker_dead_letter_attempts" // its attempts in that group
	MetaDeadLetterOffset   = "sqlbroker_dead_letter_offset"   // its offset in that topic
)

// deadLetterSQL moves claims of group $1 (offsets $2, tokens $3, fenced as the settlements of
// NewStore are) to the messages table of another topic, in one statement: the claim is
// deleted and a copy of its message, with the topic ($4), the group ($5), its attempts and
// its offset added to its metadata, is inserted there; both or neither. The metadata keys the
// subscriber sets on a delivery (attempt, offset: $6, $7) are dropped from the copy: the stored
// row carries them only if a publisher copied them from an earlier delivery. %[1]s: claims,
// %[2]s: messages, %[3]s: the dead-letter topic's messages; %[4]s and %[5]s: the
// asynchronous-commit prefix and condition.
const deadLetterSQL = `%[4]sk AS (
	SELECT x.t, a."offset" AS o FROM unnest($2::bigint[], $3::bigint[]) AS a("offset", "token"),
	LATERAL (SELECT c.ctid AS t FROM %[1]s c
		WHERE c."group_id" = $1 AND c."offset" = a."offset" AND c."token" = a."token"
		FOR UPDATE) x
), d AS (
	DELETE FROM %[1]s c
	WHERE c.ctid = ANY (ARRAY(SELECT t FROM k))%[5]s
	RETURNING c."offset", c."attempts"
), ins AS (
	INSERT INTO %[3]s ("uuid", "payload", "metadata")
	SELECT m."uuid", m."payload", (m."metadata" - $6::text - $7::text) || jsonb_build_object(
		'` + MetaDeadLetterTopic + `', $4::text, '` + MetaDeadLetterGroup + `', $5::text,
		'` + MetaDeadLetterAttempts + `', d."attempts"::text, '` + MetaDeadLetterOffset + `', m."offset"::text)
	FROM d JOIN %[2]s m ON m."offset" = d."offset"
	ORDER BY m."offset"
)
SELECT k.o, EXISTS (SELECT 1 FROM d WHERE d."offset" = k.o) FROM k`

// DeadLetter moves the fenced claims fs of the group (named group) to the messages table of
// to, another topic's store, and returns the offsets it moved; the others were stale, as for
// Ack. dropKeys are the two metadata keys (attempt, offset) the copy leaves out.
func (s *Store) DeadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to *Store, dropKeys [2]string) (map[int64]bool, error) {
	sql := fmt.Sprintf(deadLetterSQL, s.T.Claims, s.T.Messages, to.T.Messages, s.with, s.cond)
	return s.settle(ctx, q, sql, groupID, fs, s.T.Topic, group, dropKeys[0], dropKeys[1])
}
