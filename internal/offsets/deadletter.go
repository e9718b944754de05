package offsets

import (
	"context"
	"fmt"
	"strings"

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
	if s.lite != nil {
		return s.lite.deadLetter(ctx, q, s.T.Topic, groupID, group, fs, to.T.Messages, dropKeys)
	}
	sql := fmt.Sprintf(deadLetterSQL, s.T.Claims, s.T.Messages, to.T.Messages, s.with, s.cond)
	return s.settle(ctx, q, sql, groupID, fs, s.T.Topic, group, dropKeys[0], dropKeys[1])
}

// deadLetterSQLite is deadLetterSQL on SQLite, where a DELETE cannot feed an INSERT in one
// statement: the fenced claims are deleted (returning their attempts), then the copies are
// inserted from VALUES rows (offset, attempts) of the claims deleted, in the one write
// transaction, so both or neither. %[1]s: the messages table, %[2]s: the dead-letter topic's;
// ?1 and ?2 are the JSON paths of the metadata keys dropped, ?3 the topic and ?4 the group.
const deadLetterSQLite = `INSERT INTO %[2]s ("uuid", "payload", "metadata")
SELECT m."uuid", m."payload", json_set(json_remove(m."metadata", ?1, ?2),
	'$.` + MetaDeadLetterTopic + `', ?3, '$.` + MetaDeadLetterGroup + `', ?4,
	'$.` + MetaDeadLetterAttempts + `', CAST(d."column2" AS TEXT), '$.` + MetaDeadLetterOffset + `', CAST(m."offset" AS TEXT))
FROM (VALUES %[3]s) d JOIN %[1]s m ON m."offset" = d."column1"
ORDER BY m."offset"`

// deadLetter moves the fenced claims fs to the messages table to, in one write transaction,
// and returns the offsets it moved (see Store.DeadLetter).
func (s *sqliteStore) deadLetter(ctx context.Context, q dbx.Querier, topic string, groupID int32, group string, fs []Fenced, to string, dropKeys [2]string) (map[int64]bool, error) {
	done := map[int64]bool{}
	err := dbx.InSQLiteTx(ctx, q, func(tx dbx.Querier) error {
		for len(fs) > 0 {
			n := min(len(fs), sqliteSettleChunk)
			var b strings.Builder
			b.WriteString(s.dlDeletePrefix)
			args := make([]any, 0, 1+2*n)
			args = append(args, groupID)
			for i, f := range fs[:n] {
				if i > 0 {
					b.WriteByte(',')
				}
				b.WriteString("(?,?)")
				args = append(args, f.Offset, f.Token)
			}
			b.WriteString(`) RETURNING "offset", "attempts"`)
			rows, err := tx.Query(ctx, b.String(), args...)
			if err != nil {
				return err
			}
			var moved []any // offset, attempts pairs
			for rows.Next() {
				var off, att int64
				if err := rows.Scan(&off, &att); err != nil {
					rows.Close()
					return err
				}
				moved = append(moved, off, att)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			if len(moved) > 0 {
				// The four leading parameters are numbered (?1 to ?4): the VALUES rows follow
				// them as ?5 onwards.
				var vb strings.Builder
				for i := range len(moved) / 2 {
					if i > 0 {
						vb.WriteByte(',')
					}
					fmt.Fprintf(&vb, "(?%d,?%d)", 5+2*i, 6+2*i)
				}
				sql := fmt.Sprintf(deadLetterSQLite, s.messages, to, vb.String())
				iargs := append([]any{jsonPath(dropKeys[0]), jsonPath(dropKeys[1]), topic, group}, moved...)
				if _, err := tx.Exec(ctx, sql, iargs...); err != nil {
					return err
				}
				for i := 0; i < len(moved); i += 2 {
					done[moved[i].(int64)] = true
				}
			}
			fs = fs[n:]
		}
		return nil
	})
	if err != nil {
		return map[int64]bool{}, err // rolled back: nothing was moved
	}
	return done, nil
}

// jsonPath is SQLite's JSON path of the object key k, quoted so that a key with dots is one
// member (k holds no double quote: it is one of the library's metadata keys).
func jsonPath(k string) string { return `$."` + k + `"` }
