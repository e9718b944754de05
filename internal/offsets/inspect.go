package offsets

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The statements that read the state of a topic for operators (the sqlbroker command and the
// metrics collector), and those that move or drop a consumer group. None of them runs in the
// claim or settlement path.

// topicCommentPrefix starts the comment of a groups table: the topic's name follows. It is
// how a topic whose table names were shortened (see ident.TableName) is named again.
const topicCommentPrefix = "sqlbroker topic "

// Found is one topic found in the catalog.
type Found struct {
	// Topic is the topic's name. For a topic whose table names were shortened and whose
	// groups table carries no name (tables made before the name was written there), it is the
	// shortened part of the messages table's name, with Named false.
	Topic  string
	Named  bool
	Tables Tables
}

// findSQL lists, in schema $1 ("" = the search_path) the tables whose names start with $2,
// with their comments, up to $3 rows. left() compares the prefix without LIKE, whose _ would
// match any character.
const findSQL = `SELECT n.nspname, c.relname, coalesce(obj_description(c.oid, 'pg_class'), '')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND left(c.relname, length($2)) = $2
  AND (n.nspname = $1 OR $1 = '' AND pg_catalog.pg_table_is_visible(c.oid))
  AND c.relname ~ '_(messages|groups|claims)$'
ORDER BY n.nspname, c.relname
LIMIT $3`

// FindTopics lists up to limit topics whose tables exist in schema ("" = the schemas of the
// search_path, where the library's unqualified names resolve) under prefix: a messages table
// carrying the library's schema comment, with its groups and claims tables beside it. It
// returns them by name and reports whether more may exist.
func FindTopics(ctx context.Context, q dbx.Querier, schema, prefix string, limit int) ([]Found, bool, error) {
	rows, err := q.Query(ctx, findSQL, schema, prefix, limit*3+3)
	if err != nil {
		return nil, false, err
	}
	defer rows.Close()
	type parts struct {
		nsp, messages, groups, claims, comment, groupsComment string
	}
	byKey := map[string]*parts{}
	n := 0
	for rows.Next() {
		n++
		var nsp, rel, comment string
		if err := rows.Scan(&nsp, &rel, &comment); err != nil {
			return nil, false, err
		}
		var suffix string
		for _, s := range []string{"_messages", "_groups", "_claims"} {
			if strings.HasSuffix(rel, s) {
				suffix = s
			}
		}
		// The topic part: the whole topic, or for a shortened name the hash of the topic,
		// which its three tables share although their cut topic parts differ in length.
		part := strings.TrimSuffix(strings.TrimPrefix(rel, prefix), suffix)
		if i := strings.LastIndexByte(part, '#'); i >= 0 {
			part = part[i:]
		}
		key := nsp + "\x00" + part
		p := byKey[key]
		if p == nil {
			p = &parts{nsp: nsp}
			byKey[key] = p
		}
		switch suffix {
		case "_messages":
			p.messages, p.comment = rel, comment
		case "_groups":
			p.groups, p.groupsComment = rel, comment
		case "_claims":
			p.claims = rel
		}
	}
	if err := rows.Err(); err != nil {
		return nil, false, err
	}
	var out []Found
	for _, p := range byKey {
		if p.messages == "" || p.groups == "" || p.claims == "" || !strings.HasPrefix(p.comment, schemaCommentPrefix) {
			continue
		}
		f := Found{}
		if name, ok := strings.CutPrefix(p.groupsComment, topicCommentPrefix); ok && name != "" {
			f.Topic, f.Named = name, true
		} else {
			f.Topic = strings.TrimSuffix(strings.TrimPrefix(p.messages, prefix), "_messages")
			f.Named = !strings.Contains(f.Topic, "#")
		}
		// With schema "", the names are left unqualified: the search_path resolves them, as
		// it does for the library.
		f.Tables = namedTables(schema, prefix, f.Topic, p.messages, p.groups, p.claims)
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Topic < out[j].Topic })
	more := n >= limit*3+3
	if len(out) > limit {
		out, more = out[:limit], true
	}
	return out, more, nil
}

// namedTables is NewTables with the raw names read from the catalog.
func namedTables(schema, prefix, topic, messages, groups, claims string) Tables {
	t := NewTables(schema, prefix, topic)
	t.MessagesName, t.GroupsName, t.ClaimsName = messages, groups, claims
	t.Messages = qualified(schema, messages)
	t.Groups = qualified(schema, groups)
	t.Claims = qualified(schema, claims)
	return t
}

func qualified(schema, name string) string {
	q := `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
	if schema == "" {
		return q
	}
	return `"` + strings.ReplaceAll(schema, `"`, `""`) + `".` + q
}

// GroupState is what Inspect reads of one consumer group.
type GroupState struct {
	Group string
	// Offset is the offset of the last message handed out (its position).
	Offset int64
	// Lag counts the messages after the group's position, up to the cap Inspect was given;
	// past it, LagEstimated is set and Lag is the newest offset minus the group's.
	Lag          int64
	LagEstimated bool
	// InWork counts claims held by a consumer: leased (deadline in the future) or held by an
	// advisory lock.
	InWork int64
	// Waiting counts nacked claims whose backoff has not passed.
	Waiting int64
	// Due counts claims that any consumer may take again now: nacked or given back and
	// their backoff passed, or whose lease ran out.
	Due int64
	// HeldBack counts committed messages after the position that the oldest running
	// transaction of the cluster still holds back.
	HeldBack int64
	// OldestUnsettledAge is the age, in seconds, of the oldest message the group has not
	// settled: its claim with the lowest offset, or the next message after its position; 0
	// when there is none.
	OldestUnsettledAge float64
	// SinceMoved is the time in seconds since the group's position last moved.
	SinceMoved float64
}

// inspectSQL reads every consumer group of the topic, up to $2, in one statement: each
// figure is a bounded index scan (the lag and the held-back messages stop at $1 rows, the
// claims at $1 rows of the group's key range).
const inspectSQL = `SELECT g."consumer_group", g."last_offset",
	(SELECT count(*) FROM (SELECT 1 FROM %[1]s m
		WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset") LIMIT $1) x),
	coalesce((SELECT max(m."offset") FROM %[1]s m), 0),
	cl.in_work, cl.waiting, cl.due,
	(SELECT count(*) FROM (SELECT 1 FROM %[1]s m
		WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset")
		  AND m."xid" >= pg_snapshot_xmin(pg_current_snapshot()) LIMIT $1) x),
	coalesce(extract(epoch FROM now() - least(
		(SELECT m."created_at" FROM %[2]s c JOIN %[1]s m ON m."offset" = c."offset"
			WHERE c."group_id" = g."group_id" ORDER BY c."offset" LIMIT 1),
		(SELECT m."created_at" FROM %[1]s m
			WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset")
			ORDER BY m."xid", m."offset" LIMIT 1)))::float8, 0),
	extract(epoch FROM now() - g."updated_at")::float8
FROM %[3]s g,
LATERAL (SELECT
		count(*) FILTER (WHERE c."token" <> 0 AND c."visible_at" > now()) AS in_work,
		count(*) FILTER (WHERE c."token" = 0 AND c."visible_at" > now()) AS waiting,
		count(*) FILTER (WHERE c."visible_at" <= now()) AS due
	FROM (SELECT c."token", c."visible_at" FROM %[2]s c WHERE c."group_id" = g."group_id" LIMIT $1) c) cl
ORDER BY g."consumer_group"
LIMIT $2`

// Inspect reads the state of up to maxGroups consumer groups of the topic, counting at most
// countCap rows for each figure.
func (t Tables) Inspect(ctx context.Context, q dbx.Querier, countCap, maxGroups int) ([]GroupState, error) {
	rows, err := q.Query(ctx, fmt.Sprintf(inspectSQL, t.Messages, t.Claims, t.Groups), countCap, maxGroups)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []GroupState
	for rows.Next() {
		var g GroupState
		var newest int64
		if err := rows.Scan(&g.Group, &g.Offset, &g.Lag, &newest, &g.InWork, &g.Waiting, &g.Due, &g.HeldBack, &g.OldestUnsettledAge, &g.SinceMoved); err != nil {
			return nil, err
		}
		if g.Lag >= int64(countCap) {
			g.LagEstimated = true
			g.Lag = max(g.Lag, newest-g.Offset)
		}
		out = append(out, g)
	}
	return out, rows.Err()
}

// ClaimRow is one claim of a topic, as ListClaims reads it.
type ClaimRow struct {
	Group    string
	Offset   int64
	Attempts int64
	Token    int64
	// Advisory says the claim is held by an advisory lock (it has no deadline).
	Advisory bool
	// In is the time in seconds until the lease deadline or the end of the backoff;
	// negative when it has passed. 0 for an advisory claim.
	In float64
}

const claimsSQL = `SELECT g."consumer_group", c."offset", c."attempts", c."token",
	c."visible_at" = 'infinity',
	CASE WHEN c."visible_at" = 'infinity' THEN 0 ELSE extract(epoch FROM c."visible_at" - now())::float8 END
FROM %[1]s c JOIN %[2]s g ON g."group_id" = c."group_id"
ORDER BY g."consumer_group", c."offset"
LIMIT $1`

// ListClaims returns up to limit claims of the topic, by group and offset.
func (t Tables) ListClaims(ctx context.Context, q dbx.Querier, limit int) ([]ClaimRow, error) {
	rows, err := q.Query(ctx, fmt.Sprintf(claimsSQL, t.Claims, t.Groups), limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []ClaimRow
	for rows.Next() {
		var c ClaimRow
		if err := rows.Scan(&c.Group, &c.Offset, &c.Attempts, &c.Token, &c.Advisory, &c.In); err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// ErrNoGroup says that the consumer group has no row in the topic's groups table.
var ErrNoGroup = errors.New("no such consumer group")

// resetFindOffsetSQL and resetFindTimeSQL find the first message kept at or after an offset,
// or written at or after a time; the group is then placed just before it. lastSQL finds the
// last message in the order of delivery, after which the group is placed when there is none,
// and the highest offset kept, below the offset of every message published later.
const (
	resetFindOffsetSQL = `SELECT m."xid"::text, m."offset" FROM %s m WHERE m."offset" >= $1 ORDER BY m."offset" LIMIT 1`
	resetFindTimeSQL   = `SELECT m."xid"::text, m."offset" FROM %s m WHERE m."created_at" >= $1 ORDER BY m."offset" LIMIT 1`
	lastSQL            = `SELECT m."xid"::text, m."offset", (SELECT max(x."offset") FROM %[1]s x) FROM %[1]s m ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1`
	lockGroupSQL       = `SELECT "group_id" FROM %s WHERE "consumer_group" = $1 FOR UPDATE`
	setGroupSQL        = `UPDATE %s SET "last_xid" = $2::text::xid8, "last_offset" = $3, "updated_at" = now() WHERE "group_id" = $1`
	dropClaimsSQL      = `DELETE FROM %s WHERE "group_id" = $1`
	dropGroupSQL       = `DELETE FROM %s WHERE "group_id" = $1`
)

// ResetGroup moves the group's position so that the next message it is handed is the first
// one kept at or after offset (byTime false) or written at or after the time at (byTime
// true), and drops the group's claims: deliveries in work are then refused as stale. When no
// message is kept at or after that point, the group is placed after every message kept, and
// receives the next message published, whatever its offset. It returns the offset of the
// group's next message, or, when that message is still to be published, the lowest offset it
// can have: one above the highest kept.
func (t Tables) ResetGroup(ctx context.Context, b dbx.Beginner, group string, offset int64, at time.Time, byTime bool) (int64, error) {
	var next int64
	err := dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		id, err := t.lockGroup(ctx, tx, group)
		if err != nil {
			return err
		}
		var xid string
		var pos int64
		if byTime {
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(resetFindTimeSQL, t.Messages), []any{at}, &xid, &next)
		} else {
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(resetFindOffsetSQL, t.Messages), []any{offset}, &xid, &next)
		}
		switch {
		case err == nil:
			// (xid, next-1) is below the first message in the (xid, offset) order of delivery
			// and above every message before it with the same xid.
			pos = next - 1
		case errors.Is(err, dbx.ErrNoRows):
			// After every message kept: the last in the order of delivery. The next message
			// published comes after it, whatever offset was asked for, and its offset is above
			// every offset kept.
			var highest int64
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(lastSQL, t.Messages), nil, &xid, &pos, &highest)
			if errors.Is(err, dbx.ErrNoRows) {
				xid, pos, highest, err = "0", 0, 0, nil
			}
			if err != nil {
				return err
			}
			next = highest + 1
		default:
			return err
		}
		if _, err := tx.Exec(ctx, fmt.Sprintf(dropClaimsSQL, t.Claims), id); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, fmt.Sprintf(setGroupSQL, t.Groups), id, xid, pos)
		return err
	})
	return next, err
}

// lockGroup locks the group's row for the transaction tx and returns its id, or ErrNoGroup.
func (t Tables) lockGroup(ctx context.Context, tx dbx.Tx, group string) (int32, error) {
	var id int32
	err := dbx.QueryRow(ctx, tx, fmt.Sprintf(lockGroupSQL, t.Groups), []any{group}, &id)
	if errors.Is(err, dbx.ErrNoRows) {
		return 0, ErrNoGroup
	}
	return id, err
}

// DeleteGroup drops the group's row and its claims, so that it no longer holds retention
// back. It returns the number of claims dropped.
func (t Tables) DeleteGroup(ctx context.Context, b dbx.Beginner, group string) (int64, error) {
	var n int64
	err := dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		id, err := t.lockGroup(ctx, tx, group)
		if err != nil {
			return err
		}
		if n, err = tx.Exec(ctx, fmt.Sprintf(dropClaimsSQL, t.Claims), id); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, fmt.Sprintf(dropGroupSQL, t.Groups), id)
		return err
	})
	return n, err
}

// Horizon is the oldest transaction of the cluster that holds an xid: it is what
// pg_snapshot_xmin reports, and no message written after it started is delivered before it
// ends.
type Horizon struct {
	// Age is the time in seconds since that transaction started; 0 when none runs.
	Age      float64
	PID      int64 // its backend (0 for a prepared transaction)
	Prepared bool  // a prepared transaction (PREPARE TRANSACTION) waiting for COMMIT PREPARED
	// Application, State and Database are pg_stat_activity's application_name, state and
	// datname ("" where this role may not see them).
	Application, State, Database string
}

// horizonSQL finds the oldest transaction with an xid, in any database of the cluster:
// running ones from pg_stat_activity (xact_start), prepared ones from pg_prepared_xacts.
// backend_xid is shown to roles that may see the session (pg_read_all_stats).
const horizonSQL = `SELECT * FROM (
	SELECT extract(epoch FROM now() - a.xact_start)::float8, a.pid::bigint, false,
		coalesce(a.application_name, ''), coalesce(a.state, ''), coalesce(a.datname, ''), age(a.backend_xid)
	FROM pg_catalog.pg_stat_activity a
	WHERE a.backend_xid IS NOT NULL AND a.xact_start IS NOT NULL
	UNION ALL
	SELECT extract(epoch FROM now() - p.prepared)::float8, 0::bigint, true, p.gid, 'prepared', p.database, age(p.transaction)
	FROM pg_catalog.pg_prepared_xacts p
) x ORDER BY 7 DESC LIMIT 1`

// ReadHorizon reads the oldest transaction holding the xmin horizon back.
func ReadHorizon(ctx context.Context, q dbx.Querier) (Horizon, error) {
	var h Horizon
	var age int64
	err := dbx.QueryRow(ctx, q, horizonSQL, nil, &h.Age, &h.PID, &h.Prepared, &h.Application, &h.State, &h.Database, &age)
	if errors.Is(err, dbx.ErrNoRows) {
		return Horizon{}, nil
	}
	return h, err
}

// AdvisoryHolder is a session holding one of the library's message locks.
type AdvisoryHolder struct {
	Key1, Key2 int32
	PID        int64
}

// advisoryHoldersSQL lists the message locks of the library (key1 in [$1, $2]) held in this
// database. It copies the server's whole lock table: for the command, not for a scrape.
const advisoryHoldersSQL = `SELECT l.classid::bigint, l.objid::bigint, l.pid::bigint
FROM pg_catalog.pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
  AND l.classid::bigint BETWEEN $1 AND $2`

// AdvisoryHolders returns the sessions that hold message locks with key1 in [first, last].
func AdvisoryHolders(ctx context.Context, q dbx.Querier, first, last uint32) ([]AdvisoryHolder, error) {
	rows, err := q.Query(ctx, advisoryHoldersSQL, int64(first), int64(last))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []AdvisoryHolder
	for rows.Next() {
		var k1, k2, pid int64
		if err := rows.Scan(&k1, &k2, &pid); err != nil {
			return nil, err
		}
		out = append(out, AdvisoryHolder{Key1: int32(uint32(k1)), Key2: int32(uint32(k2)), PID: pid})
	}
	return out, rows.Err()
}
