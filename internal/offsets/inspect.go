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
// claim or settlement path. Their text is the database's (inspectStatements); a database
// without them refuses them with ErrNoInspection.

// inspectStatements are the texts of the operator statements of a database. Those with %[n]s
// verbs take a topic's tables: see each use.
type inspectStatements struct {
	find            string // tables of schema $1 whose names start with $2, with their comments, up to $3
	inspect         string // every group of the topic: position, lag, claims, held back, ages
	claims          string // the claims of the topic, by group and offset
	resetFindOffset string // the first message kept at or after offset $1
	resetFindTime   string // the first message written at or after $1
	last            string // the last message in the order of delivery, and the highest offset
	lockGroup       string // the group's row, locked for the transaction
	setGroup        string // the group's new position
	dropClaims      string // the group's claims
	dropGroup       string // the group's row
	horizon         string // the oldest transaction holding the horizon back ("": none, see Horizon.NotApplicable)
	advisoryHolders string // the sessions holding message locks ("": no advisory locks)
}

// ErrNoInspection says that the database has no operator statements (listing topics,
// inspecting or moving groups).
var ErrNoInspection = errors.New("offsets: the database has no catalog to inspect")

// Inspects reports whether a database of dialect d has the operator statements.
func Inspects(d dbx.Dialect) bool { return databaseOf(d).inspection() != nil }

// inspection returns the operator statements of db, or ErrNoInspection.
func inspection(db database) (*inspectStatements, error) {
	if sql := db.inspection(); sql != nil {
		return sql, nil
	}
	return nil, ErrNoInspection
}

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

// FindTopics lists up to limit topics whose tables exist in schema ("" = the schemas of the
// search_path, where the library's unqualified names resolve) under prefix: a messages table
// carrying the library's schema comment, with its groups and claims tables beside it. It
// returns them by name and reports whether more may exist.
func FindTopics(ctx context.Context, q dbx.Querier, schema, prefix string, limit int) ([]Found, bool, error) {
	db := databaseOf(dbx.DialectOf(q))
	sql, err := inspection(db)
	if err != nil {
		return nil, false, err
	}
	rows, err := q.Query(ctx, sql.find, schema, prefix, limit*3+3)
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
		f.Tables = namedTables(db, schema, prefix, f.Topic, p.messages, p.groups, p.claims)
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Topic < out[j].Topic })
	more := n >= limit*3+3
	if len(out) > limit {
		out, more = out[:limit], true
	}
	return out, more, nil
}

// namedTables is NewTables on db with the raw names read from the catalog.
func namedTables(db database, schema, prefix, topic, messages, groups, claims string) Tables {
	t := NewTables(schema, prefix, topic)
	t.db = db
	t.MessagesName, t.GroupsName, t.ClaimsName = messages, groups, claims
	t.Messages = db.quote(schema, messages)
	t.Groups = db.quote(schema, groups)
	t.Claims = db.quote(schema, claims)
	return t
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
	// Parked counts messages of a group ordered by key that wait behind an earlier message
	// of their key.
	Parked int64
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

// Inspect reads the state of up to maxGroups consumer groups of the topic, counting at most
// countCap rows for each figure.
func (t Tables) Inspect(ctx context.Context, q dbx.Querier, countCap, maxGroups int) ([]GroupState, error) {
	sql, err := inspection(t.database())
	if err != nil {
		return nil, err
	}
	rows, err := q.Query(ctx, fmt.Sprintf(sql.inspect, t.Messages, t.Claims, t.Groups), countCap, maxGroups)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []GroupState
	for rows.Next() {
		var g GroupState
		var newest int64
		if err := rows.Scan(&g.Group, &g.Offset, &g.Lag, &newest, &g.InWork, &g.Waiting, &g.Due, &g.Parked, &g.HeldBack, &g.OldestUnsettledAge, &g.SinceMoved); err != nil {
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
	// Parked says the message waits behind an earlier message of its key (it has no
	// deadline).
	Parked bool
	// In is the time in seconds until the lease deadline or the end of the backoff;
	// negative when it has passed. 0 for an advisory claim.
	In float64
}

// ListClaims returns up to limit claims of the topic, by group and offset.
func (t Tables) ListClaims(ctx context.Context, q dbx.Querier, limit int) ([]ClaimRow, error) {
	sql, err := inspection(t.database())
	if err != nil {
		return nil, err
	}
	rows, err := q.Query(ctx, fmt.Sprintf(sql.claims, t.Claims, t.Groups), limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []ClaimRow
	for rows.Next() {
		var c ClaimRow
		if err := rows.Scan(&c.Group, &c.Offset, &c.Attempts, &c.Token, &c.Advisory, &c.Parked, &c.In); err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// ErrNoGroup says that the consumer group has no row in the topic's groups table.
var ErrNoGroup = errors.New("no such consumer group")

// ResetGroup moves the group's position so that the next message it is handed is the first
// one kept at or after offset (byTime false) or written at or after the time at (byTime
// true), and drops the group's claims: deliveries in work are then refused as stale. When no
// message is kept at or after that point, the group is placed after every message kept, and
// receives the next message published, whatever its offset. It returns the offset of the
// group's next message, or, when that message is still to be published, the lowest offset it
// can have: one above the highest kept.
func (t Tables) ResetGroup(ctx context.Context, b dbx.Beginner, group string, offset int64, at time.Time, byTime bool) (int64, error) {
	sql, err := inspection(t.database())
	if err != nil {
		return 0, err
	}
	var next int64
	err = dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		id, err := t.lockGroup(ctx, tx, sql, group)
		if err != nil {
			return err
		}
		var xid string
		var pos int64
		if byTime {
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(sql.resetFindTime, t.Messages), []any{t.database().deliverAt(at)}, &xid, &next)
		} else {
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(sql.resetFindOffset, t.Messages), []any{offset}, &xid, &next)
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
			err = dbx.QueryRow(ctx, tx, fmt.Sprintf(sql.last, t.Messages), nil, &xid, &pos, &highest)
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
		if _, err := tx.Exec(ctx, fmt.Sprintf(sql.dropClaims, t.Claims), id); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, fmt.Sprintf(sql.setGroup, t.Groups), id, xid, pos)
		return err
	})
	return next, err
}

// lockGroup locks the group's row for the transaction tx and returns its id, or ErrNoGroup.
func (t Tables) lockGroup(ctx context.Context, tx dbx.Tx, sql *inspectStatements, group string) (int32, error) {
	var id int32
	err := dbx.QueryRow(ctx, tx, fmt.Sprintf(sql.lockGroup, t.Groups), []any{group}, &id)
	if errors.Is(err, dbx.ErrNoRows) {
		return 0, ErrNoGroup
	}
	return id, err
}

// DeleteGroup drops the group's row and its claims, so that it no longer holds retention
// back. It returns the number of claims dropped.
func (t Tables) DeleteGroup(ctx context.Context, b dbx.Beginner, group string) (int64, error) {
	sql, err := inspection(t.database())
	if err != nil {
		return 0, err
	}
	var n int64
	err = dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		id, err := t.lockGroup(ctx, tx, sql, group)
		if err != nil {
			return err
		}
		if n, err = tx.Exec(ctx, fmt.Sprintf(sql.dropClaims, t.Claims), id); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, fmt.Sprintf(sql.dropGroup, t.Groups), id)
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
	// NotApplicable says that the database has no such horizon (SQLite: offsets commit in
	// order, and nothing is held back); the other fields are then zero.
	NotApplicable bool
}

// ReadHorizon reads the oldest transaction holding the xmin horizon back.
func ReadHorizon(ctx context.Context, q dbx.Querier) (Horizon, error) {
	sql, err := inspection(databaseOf(dbx.DialectOf(q)))
	if err != nil {
		return Horizon{}, err
	}
	if sql.horizon == "" {
		return Horizon{NotApplicable: true}, nil
	}
	var h Horizon
	var age int64
	err = dbx.QueryRow(ctx, q, sql.horizon, nil, &h.Age, &h.PID, &h.Prepared, &h.Application, &h.State, &h.Database, &age)
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

// AdvisoryHolders returns the sessions that hold message locks with key1 in [first, last]:
// none on a database without advisory locks.
func AdvisoryHolders(ctx context.Context, q dbx.Querier, first, last uint32) ([]AdvisoryHolder, error) {
	sql, err := inspection(databaseOf(dbx.DialectOf(q)))
	if err != nil {
		return nil, err
	}
	if sql.advisoryHolders == "" {
		return nil, nil
	}
	rows, err := q.Query(ctx, sql.advisoryHolders, int64(first), int64(last))
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
