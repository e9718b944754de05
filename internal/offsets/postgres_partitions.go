package offsets

// PostgreSQL's messages table in partitions by offset range, and their maintenance.
//
// The messages table is partitioned by range of "offset" (native partitioning). Its offsets
// come from a sequence of its own (PostgreSQL 15 has no identity column on a partitioned
// table), drawn only after the inserting transaction has its transaction id: the column's
// default is CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(...) END, and CASE
// evaluates its condition first. That order is what lets a partition be known complete
// (closed, below).
//
// Partitions are added ahead of the sequence by a function of the topic (extendFnSQL), which
// every creator calls: SchemaSQL, each maintenance pass, and a publisher that met a row with
// no partition (SQLSTATE 23514), which then writes again once. It runs with the rights of
// its owner, so that a role with only row rights can call it.
//
// Retention removes whole partitions: one is detached (DETACH PARTITION ... CONCURRENTLY,
// which waits for no claim or publish and makes none wait) and dropped once it is closed,
// every consumer group has passed every message in it, no claim holds any of its offsets,
// and every message in it is older than the retention. Nothing is deleted row by row.
//
// Closed: no row can still enter the partition, and every row in it is committed or rolled
// back. A pass reads s, the highest offset committed, then, in a later statement, w, a
// transaction id of its own (pg_current_xact_id, which hands out the next one). Every offset
// up to s was drawn before s's own row committed, by a transaction that had its id before it
// drew, so below w; once the oldest running transaction is newer than w (pg_snapshot_xmin),
// all of them have ended, and every offset drawn later is above s. A partition whose offsets all lie at or
// below s is then closed. The pass that sees it writes the time into the partition's comment
// ("sqlbroker: messages before <ms>"): every message in it was written before that time, the
// bound retention compares with (a transaction's created_at is its start, before it ends).
//
// The claims read only the partitions their group may still need: each group row carries
// floor_offset, the lower bound of the first partition that is not closed or holds a message
// after the group's position, and every read of the messages after a group's position adds
// "offset >= floor_offset", which the executor uses to skip the partitions below it without
// opening them. A pass moves the floors up; ResetGroup sets the group's back to 0.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// PartitionSize is the fewest offsets a partition of a PostgreSQL messages table spans. A new
// partition spans at least a quarter of the offsets the table holds (partitionShare), rounded
// up to a multiple of PartitionSize, so that the number of partitions stays about five plus
// those made ahead however long the retention or the backlog.
const PartitionSize = 100_000

// partitionShare: a new partition spans at least 1/partitionShare of the offsets between the
// lowest partition kept and the sequence.
const partitionShare = 4

// MaintainLockKey1 is the first half of the session advisory lock key under which one
// maintenance pass at a time removes a topic's partitions; the second half is the schema
// lock's (derived from the messages table name).
const MaintainLockKey1 int32 = 0x53426D74 // "SBmt"

// closedCommentPrefix starts the comment of a closed partition, followed by the time in Unix
// milliseconds before which every message in it was written.
const closedCommentPrefix = "sqlbroker: messages before "

// detachLockTimeout bounds the waits of DETACH PARTITION ... CONCURRENTLY (for the
// transactions that use the table when it starts): one that runs out leaves the detach
// pending, and the next pass completes it.
const detachLockTimeout = "2s"

// finalizeLockTimeout bounds the wait of DETACH PARTITION ... FINALIZE, which completes a
// detach that a transaction outlasted. It asks for an ACCESS EXCLUSIVE lock on the partition,
// and while it waits every claim of the topic waits behind it (a claim's plan locks each
// partition), so it runs only when no other session holds a lock on the partition, and waits
// for one that takes one meanwhile only this long.
const finalizeLockTimeout = "50ms"

// errPartitionInUse says that another session holds a lock on a partition whose detach is
// pending (a long transaction that read the table before the detach began): the detach stays
// pending, and a later pass completes it.
var errPartitionInUse = errors.New("offsets: a partition whose detach is pending is still in use")

// extendFnSQL is the function that adds partitions to the messages table: given the number
// of rows about to be written (n_rows) and the fewest offsets of a partition (n_least), it
// adds partitions until they reach n_rows plus two partitions past the next offset of the
// sequence, and returns the upper bound of the highest partition. Each new partition spans
// at least n_least offsets and a 1/partitionShare of those from the lowest partition to the
// sequence (rounded up to a multiple of n_least), and at least to n_rows past the sequence.
// Callers are serialised by the schema advisory lock. A partition is made empty, with its
// indexes, then attached (SHARE UPDATE EXCLUSIVE on the table: claims and publishes go on).
// SECURITY DEFINER: it runs with the rights of the tables' owner, with a search_path that
// puts pg_catalog first and pg_temp last (set by schemaSQL), and every name in it qualified
// by the table's schema.
func extendFnSQL(t Tables) string {
	body := strings.NewReplacer(
		"{messages}", quoteLiteral(t.Messages),
		"{seq}", t.seq("_m_seq"),
		"{stem}", quoteLiteral(t.partStem()+"_p"),
		"{key1}", strconv.Itoa(int(SchemaLockKey1)),
		"{key2}", strconv.Itoa(int(t.lockKey2())),
		"{share}", strconv.Itoa(partitionShare),
	).Replace(`
DECLARE
	nsp  text;
	nxt  bigint;
	low  bigint;
	top  bigint;
	step bigint;
	hi   bigint;
	part text;
BEGIN
	IF n_rows IS NULL OR n_rows < 0 OR n_least IS NULL OR n_least < 1 THEN
		RAISE EXCEPTION 'sqlbroker: rows (%) must be 0 or more and the partition size (%) 1 or more', n_rows, n_least;
	END IF;
	PERFORM pg_advisory_xact_lock({key1}, {key2});
	SELECT c.relnamespace::regnamespace::text INTO nsp FROM pg_class c WHERE c.oid = {messages}::regclass;
	SELECT CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END INTO nxt FROM {seq} s;
	SELECT min(b.lo), max(b.hi) INTO low, top FROM (
		SELECT substring(x.b FROM 'FROM \(''(-?\d+)''\)')::bigint AS lo, substring(x.b FROM 'TO \(''(-?\d+)''\)')::bigint AS hi
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid, pg_get_expr(c.relpartbound, c.oid) x(b)
		WHERE i.inhparent = {messages}::regclass
	) b;
	step := greatest(n_least, (nxt - coalesce(low, nxt)) / {share});
	step := (step + n_least - 1) / n_least * n_least;
	top := coalesce(top, nxt);
	WHILE top <= nxt + n_rows + 2 * step LOOP
		hi := greatest(top + step, nxt + n_rows);
		part := {stem} || top;
		EXECUTE format('CREATE TABLE %s.%I (LIKE %s)', nsp, part, {messages});
		EXECUTE format('ALTER TABLE %s.%I ADD CONSTRAINT %I PRIMARY KEY ("offset")', nsp, part, part || '_pkey');
		EXECUTE format('CREATE INDEX %I ON %s.%I ("xid", "offset")', part || '_xid', nsp, part);
		EXECUTE format('ALTER TABLE %s ATTACH PARTITION %s.%I FOR VALUES FROM (%s) TO (%s)', {messages}, nsp, part, top, hi);
		top := hi;
	END LOOP;
	RETURN top;
END `)
	tag := dollarTag(body)
	fn := t.extendFn()
	var b strings.Builder
	fmt.Fprintf(&b, "CREATE OR REPLACE FUNCTION %s(n_rows bigint, n_least bigint) RETURNS bigint\nLANGUAGE plpgsql SECURITY DEFINER AS %s%s%s;\n", fn, tag, body, tag)
	set := fmt.Sprintf(` BEGIN
	EXECUTE format('ALTER FUNCTION %%s(bigint, bigint) SET search_path = pg_catalog, %%s, pg_temp', %[1]s,
		(SELECT c.relnamespace::regnamespace::text FROM pg_catalog.pg_class c WHERE c.oid = %[2]s::regclass));
END `, quoteLiteral(fn), quoteLiteral(t.Messages))
	tag = dollarTag(set)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, set, tag)
	fmt.Fprintf(&b, "REVOKE ALL ON FUNCTION %s(bigint, bigint) FROM PUBLIC;\n", fn)
	return b.String()
}

// messagesSchemaSQL writes the DDL of the messages table: the sequence, the partitioned
// table, its indexes and the function that adds partitions. A messages table of schema
// version 3 or older (a plain table with an identity column) becomes the table's first
// partition, in place: it loses its identity (the new sequence starts after the highest
// offset it handed out), is renamed to the partition's name (its indexes too), and is
// attached for every offset below the sequence's start (which reads it once, to check the
// bound). It is closed from the start: its comment carries the time of its newest message.
// The partitions that follow are added by the function (the caller calls it last).
func messagesSchemaSQL(b *strings.Builder, t Tables) {
	p0 := t.PartitionName(0)
	p0q := ident.Qualified(t.Schema, p0)
	up := fmt.Sprintf(` DECLARE
	start  bigint;
	newest bigint;
BEGIN
	IF to_regclass(%[1]s) IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = to_regclass(%[1]s) AND attname = 'deliver_at' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s ADD COLUMN "deliver_at" timestamptz;
	END IF;
	IF (SELECT c.relkind FROM pg_catalog.pg_class c WHERE c.oid = to_regclass(%[1]s)) = 'r' THEN
		LOCK TABLE %[2]s IN ACCESS EXCLUSIVE MODE;
		SELECT greatest(coalesce(max(m."offset"), 0),
			coalesce(pg_sequence_last_value(pg_get_serial_sequence(%[1]s, 'offset')::regclass), 0)) + 1,
			coalesce((extract(epoch FROM max(m."created_at")) * 1000)::bigint, 0)
		INTO start, newest FROM %[2]s m;
		ALTER TABLE %[2]s ALTER COLUMN "offset" DROP IDENTITY;
		ALTER TABLE %[2]s RENAME TO %[3]s;
		ALTER INDEX %[4]s RENAME TO %[5]s;
		ALTER INDEX %[6]s RENAME TO %[7]s;
		EXECUTE format('CREATE SEQUENCE %%s AS bigint START %%s CACHE 1', %[8]s, start);
		EXECUTE format('COMMENT ON TABLE %%s IS %%L', %[9]s, %[10]s || newest);
	END IF;
END `, quoteLiteral(t.Messages), t.Messages, ident.Quote(p0),
		ident.Qualified(t.Schema, ident.TableName(t.prefix, t.Topic, "_m_pkey")), ident.Quote(p0+"_pkey"),
		ident.Qualified(t.Schema, ident.TableName(t.prefix, t.Topic, "_m_xid")), ident.Quote(p0+"_xid"),
		quoteLiteral(t.seq("_m_seq")), quoteLiteral(p0q), quoteLiteral(closedCommentPrefix))
	tag := dollarTag(up)
	fmt.Fprintf(b, "DO %s%s%s;\n", tag, up, tag)

	// CACHE 1: a session never holds offsets it drew ahead, so that an offset below the
	// sequence is never drawn later (see closed, above).
	fmt.Fprintf(b, "CREATE SEQUENCE IF NOT EXISTS %s AS bigint CACHE 1;\n", t.seq("_m_seq"))
	fmt.Fprintf(b, `CREATE TABLE IF NOT EXISTS %s (
	"offset"     bigint      NOT NULL DEFAULT (CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval(%s::regclass) END),
	"xid"        xid8        NOT NULL DEFAULT pg_current_xact_id(),
	"uuid"       text        NOT NULL,
	"payload"    bytea       NOT NULL,
	"metadata"   jsonb       NOT NULL DEFAULT '{}',
	"created_at" timestamptz NOT NULL DEFAULT now(),
	"deliver_at" timestamptz,
	CONSTRAINT %s PRIMARY KEY ("offset")
) PARTITION BY RANGE ("offset");
`, t.Messages, quoteLiteral(t.seq("_m_seq")), t.obj("_m_pkey"))
	fmt.Fprintf(b, "CREATE INDEX IF NOT EXISTS %s ON %s (\"xid\", \"offset\");\n", t.obj("_m_xid"), t.Messages)
	// The sequence goes with the table when it is dropped.
	own := fmt.Sprintf(` BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = %[1]s::regclass AND d.deptype = 'a') THEN
		ALTER SEQUENCE %[2]s OWNED BY %[3]s."offset";
	END IF;
END `, quoteLiteral(t.seq("_m_seq")), t.seq("_m_seq"), t.Messages)
	tag = dollarTag(own)
	fmt.Fprintf(b, "DO %s%s%s;\n", tag, own, tag)
	b.WriteString(extendFnSQL(t))
	attach := fmt.Sprintf(` BEGIN
	IF (SELECT NOT c.relispartition FROM pg_catalog.pg_class c WHERE c.oid = to_regclass(%[1]s)) THEN
		EXECUTE format('ALTER TABLE %%s ATTACH PARTITION %%s FOR VALUES FROM (MINVALUE) TO (%%s)', %[2]s, %[1]s,
			(SELECT CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END FROM %[3]s s));
	END IF;
END `, quoteLiteral(p0q), quoteLiteral(t.Messages), t.seq("_m_seq"))
	tag = dollarTag(attach)
	fmt.Fprintf(b, "DO %s%s%s;\n", tag, attach, tag)
}

// addPartitionsSQL calls the function that adds partitions.
func (t Tables) addPartitionsSQL() string {
	return fmt.Sprintf("SELECT %s($1::bigint, $2::bigint)", t.extendFn())
}

// addPartitions makes sure partitions reach past the next n offsets (see extendFnSQL).
func (s postgres) addPartitions(ctx context.Context, q dbx.Querier, n int) error {
	_, err := q.Exec(ctx, s.t.addPartitionsSQL(), int64(n), int64(PartitionSize))
	return err
}

// noPartition reports whether err is the server's refusal of a row that no partition of the
// messages table takes (SQLSTATE 23514: no partition of relation ... found for row).
func (postgres) noPartition(err error) bool {
	return dbx.SQLState(err) == dbx.CodeCheckViolation
}

// partition is one partition of the messages table, as a maintenance pass reads it.
type partition struct {
	name     string // unquoted, in the messages table's schema
	lo, hi   int64  // its offsets: [lo, hi); lo is 0 for the partition from MINVALUE
	pending  bool   // its DETACH ... CONCURRENTLY was interrupted: it is no longer in the table
	detached bool   // detached, not dropped (a pass stopped in between)
	before   int64  // from its comment: every message in it was written before this (Unix ms); 0 when not known closed
}

// partitionsSQL lists the partitions of the messages table ($1), in offset order.
const partitionsSQL = `SELECT c.relname::text,
	coalesce(substring(x.b FROM 'FROM \(''(-?\d+)''\)')::bigint, 0),
	substring(x.b FROM 'TO \(''(-?\d+)''\)')::bigint,
	i.inhdetachpending,
	coalesce(obj_description(c.oid, 'pg_class'), '')
FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid,
	pg_catalog.pg_get_expr(c.relpartbound, c.oid) x(b)
WHERE i.inhparent = to_regclass($1)
ORDER BY 3`

// partState is what a Store's maintenance remembers between passes: the pair (s, w) waiting
// for the oldest running transaction to pass w, the offsets known final (below closedBelow),
// and the last message of each closed partition in the order of delivery (a closed partition
// never changes).
type partState struct {
	pendS, pendW uint64
	pend         bool
	closedBelow  int64
	last         map[int64]position

	// pruned is, on MySQL, an offset at or below which every message was deleted by an
	// earlier pass (see mysql.maintain).
	pruned int64
}

// position is a place in the order of delivery: (xid, offset). none marks a partition with
// no message.
type position struct {
	xid  uint64
	off  int64
	none bool
}

func (p position) after(q position) bool {
	return p.xid > q.xid || p.xid == q.xid && p.off > q.off
}

// MaintainOptions say what a maintenance pass does besides adding partitions and moving the
// groups' floors.
type MaintainOptions struct {
	// Drop removes the partitions whose messages every group has passed and no claim holds,
	// and that were written more than OlderThan ago; it needs the tables' owner.
	Drop      bool
	OlderThan time.Duration
	// Wait is how long the pass may wait for the transactions running when it started to
	// end, to learn which partitions are closed; without it, a partition filled since the
	// last pass is learned closed by the next one.
	Wait time.Duration
}

// MaintainResult is what a pass did.
type MaintainResult struct {
	Added    bool  // partitions were added
	Dropped  int   // partitions detached and dropped
	Messages int64 // messages in them
	Waiting  bool  // a detach waits for a transaction that uses the table (a later pass completes it)
}

// group as a maintenance pass reads it.
type groupRow struct {
	id    int32
	pos   position
	floor int64
}

// maintain runs one maintenance pass on the connection c (not in a transaction: DETACH ...
// CONCURRENTLY cannot run in one).
func (s postgres) maintain(ctx context.Context, st *partState, c dbx.Querier, opts MaintainOptions) (MaintainResult, error) {
	var res MaintainResult
	t := s.t
	var top int64
	if err := dbx.QueryRowWrite(ctx, c, t.addPartitionsSQL(), []any{int64(0), int64(PartitionSize)}, &top); err != nil {
		return res, fmt.Errorf("adding partitions: %w", err)
	}
	if err := s.analyzeGrown(ctx, c); err != nil {
		return res, fmt.Errorf("analyzing the claims table: %w", err)
	}
	// Which offsets are final: the pair (s, w) of the last pass, if the transactions that were
	// running when it was taken have ended; then a new pair.
	deadline := time.Now().Add(opts.Wait)
	confirmed := false
	for {
		var xmin string
		var newest int64
		if err := dbx.QueryRow(ctx, c, fmt.Sprintf(`SELECT pg_snapshot_xmin(pg_current_snapshot())::text, coalesce((SELECT max("offset") FROM %s), 0)`, t.Messages), nil, &xmin, &newest); err != nil {
			return res, err
		}
		xm, err := strconv.ParseUint(xmin, 10, 64)
		if err != nil {
			return res, fmt.Errorf("pg_snapshot_xmin %q: %w", xmin, err)
		}
		if st.pend && xm > st.pendW {
			st.closedBelow = max(st.closedBelow, int64(st.pendS)+1)
			st.pend, confirmed = false, true
		}
		if !st.pend && newest >= st.closedBelow {
			var xid string
			if err := dbx.QueryRowWrite(ctx, c, `SELECT pg_current_xact_id()::text`, nil, &xid); err != nil {
				return res, err
			}
			w, err := strconv.ParseUint(xid, 10, 64)
			if err != nil {
				return res, fmt.Errorf("pg_current_xact_id %q: %w", xid, err)
			}
			st.pendS, st.pendW, st.pend = uint64(newest), w, true
		}
		// With opts.Wait, until one pair (the last pass's or this one's) is confirmed: the
		// pair taken after it is the next pass's.
		if confirmed || !st.pend || opts.Wait <= 0 || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}

	parts, now, err := s.partitions(ctx, c)
	if err != nil {
		return res, err
	}
	closed := func(p partition) bool { return p.before > 0 || p.hi <= st.closedBelow }
	groups, err := s.groups(ctx, c)
	if err != nil {
		return res, err
	}
	// The last message of each closed partition in the order of delivery.
	if st.last == nil {
		st.last = map[int64]position{}
	}
	for _, p := range parts {
		if !closed(p) || p.pending {
			continue
		}
		if _, ok := st.last[p.lo]; ok {
			continue
		}
		var xid string
		var off int64
		err := dbx.QueryRow(ctx, c, fmt.Sprintf(`SELECT m."xid"::text, m."offset" FROM %s m
WHERE m."offset" >= $1 AND m."offset" < $2 ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1`, t.Messages), []any{p.lo, p.hi}, &xid, &off)
		switch {
		case errors.Is(err, dbx.ErrNoRows):
			st.last[p.lo] = position{none: true}
		case err != nil:
			return res, err
		default:
			x, err := strconv.ParseUint(xid, 10, 64)
			if err != nil {
				return res, fmt.Errorf("xid %q: %w", xid, err)
			}
			st.last[p.lo] = position{xid: x, off: off}
		}
	}
	passed := func(p partition, g groupRow) bool {
		if p.pending {
			return true
		}
		l, ok := st.last[p.lo]
		return closed(p) && ok && (l.none || !l.after(g.pos))
	}
	// Floors: the lower bound of the first partition each group may still need.
	for _, g := range groups {
		floor := int64(math.MaxInt64)
		for _, p := range parts {
			if !passed(p, g) {
				floor = p.lo
				break
			}
		}
		if floor == math.MaxInt64 || floor <= g.floor {
			continue
		}
		if _, err := c.Exec(ctx, fmt.Sprintf(`UPDATE %s SET "floor_offset" = $2
WHERE "group_id" = $1 AND "floor_offset" < $2 AND ("last_xid", "last_offset") >= ($3::text::xid8, $4)`, t.Groups),
			g.id, floor, strconv.FormatUint(g.pos.xid, 10), g.pos.off); err != nil {
			return res, fmt.Errorf("moving the floor of group %d: %w", g.id, err)
		}
	}
	if !opts.Drop {
		return res, nil
	}
	for i := range parts {
		p := &parts[i]
		if p.before == 0 && p.hi <= st.closedBelow {
			// Closed now: every message in it was written before now. (The owner's right.)
			q := ident.Qualified(t.Schema, p.name)
			if _, err := c.Exec(ctx, fmt.Sprintf("COMMENT ON TABLE %s IS %s", q, quoteLiteral(closedCommentPrefix+strconv.FormatInt(now, 10)))); err != nil {
				return res, fmt.Errorf("marking partition %s closed: %w", q, err)
			}
			p.before = now
		}
	}
	if len(groups) == 0 {
		return res, nil
	}

	// Partitions to drop: closed, passed by every group, old enough, and not held by a claim.
	var cands []partition
	for _, p := range parts {
		ok := p.pending || closed(p) && p.before > 0 && p.before <= now-opts.OlderThan.Milliseconds()
		for _, g := range groups {
			ok = ok && passed(p, g)
		}
		if ok {
			cands = append(cands, p)
		}
	}
	orphans, err := s.detached(ctx, c)
	if err != nil {
		return res, err
	}
	if len(cands) == 0 && len(orphans) == 0 {
		return res, nil
	}
	// A pending detach goes on whatever the claims hold (its messages are passed and
	// settled: the claims were checked when it began); the others are checked here, which
	// reads the claims table whole, so only when there is one.
	var fresh []partition
	for _, p := range cands {
		if !p.pending {
			fresh = append(fresh, p)
		}
	}
	held := map[int64]bool{}
	if len(fresh) > 0 {
		if held, err = s.heldPartitions(ctx, c, fresh); err != nil {
			return res, err
		}
	}
	var locked bool
	if err := dbx.QueryRow(ctx, c, `SELECT pg_try_advisory_lock($1::int4, $2::int4)`, []any{MaintainLockKey1, t.lockKey2()}, &locked); err != nil {
		return res, err
	}
	if !locked {
		return res, nil // another pass is removing them
	}
	var was string
	err = dbx.QueryRow(ctx, c, `SELECT current_setting('lock_timeout')`, nil, &was)
	defer func() {
		cctx, cancel := dbx.CleanupContext(ctx)
		defer cancel()
		_, _ = c.Exec(cctx, `SELECT pg_advisory_unlock($1::int4, $2::int4), set_config('lock_timeout', $3, false)`, MaintainLockKey1, t.lockKey2(), was)
	}()
	if err != nil {
		return res, err
	}
	if _, err := c.Exec(ctx, `SELECT set_config('lock_timeout', $1, false)`, detachLockTimeout); err != nil {
		return res, err
	}
	for _, name := range orphans {
		n, err := s.dropPartition(ctx, c, partition{name: name, detached: true})
		if dbx.SQLState(err) == dbx.CodeLockNotAvailable {
			res.Waiting = true
			return res, nil
		}
		if err != nil {
			return res, err
		}
		res.Dropped++
		res.Messages += n
	}
	for _, p := range cands {
		if held[p.lo] && !p.pending {
			continue
		}
		n, err := s.dropPartition(ctx, c, p)
		if dbx.SQLState(err) == dbx.CodeLockNotAvailable || errors.Is(err, errPartitionInUse) {
			// A transaction that uses the table outlasted the detach's wait: the detach
			// stays pending, and a later pass completes it.
			res.Waiting = true
			return res, nil
		}
		if err != nil {
			return res, err
		}
		res.Dropped++
		res.Messages += n
		delete(st.last, p.lo)
	}
	return res, nil
}

// analyzeMinPages is the size of the claims table below which analyzeGrown leaves it be: a
// sequential scan of it costs no more than any other plan.
const analyzeMinPages = 16

// analyzeGrown analyzes the claims table when it has at least doubled since the server last
// measured it (and is owned by the session's role). The server plans a prepared statement
// for the table's size when it first runs it, and keeps that plan until the table's
// statistics change: a settlement planned while the table was a page or two reads it by a
// sequential scan, and goes on doing so once settled claims whose versions vacuum may not
// remove yet (autovacuum off or behind, a transaction holding the xmin horizon) have grown
// it to thousands of pages, where it reads the rows it changes by their addresses. An
// ANALYZE has those plans made again. It skips a table that autovacuum is processing.
func (s postgres) analyzeGrown(ctx context.Context, c dbx.Querier) error {
	var grown bool
	err := dbx.QueryRow(ctx, c, `SELECT pg_has_role(c.relowner, 'USAGE')
	AND pg_relation_size(c.oid) / current_setting('block_size')::bigint >= greatest(2 * c.relpages, $2)
FROM pg_catalog.pg_class c WHERE c.oid = to_regclass($1)`, []any{s.t.Claims, analyzeMinPages}, &grown)
	if err != nil || !grown {
		return err
	}
	_, err = c.Exec(ctx, "ANALYZE (SKIP_LOCKED) "+s.t.Claims)
	return err
}

// partitions lists the partitions of the messages table, with the time of the statement
// (Unix ms).
func (s postgres) partitions(ctx context.Context, q dbx.Querier) ([]partition, int64, error) {
	var now int64
	if err := dbx.QueryRow(ctx, q, `SELECT (extract(epoch FROM now()) * 1000)::bigint`, nil, &now); err != nil {
		return nil, 0, err
	}
	rows, err := q.Query(ctx, partitionsSQL, s.t.Messages)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	var out []partition
	for rows.Next() {
		var p partition
		var comment string
		if err := rows.Scan(&p.name, &p.lo, &p.hi, &p.pending, &comment); err != nil {
			return nil, 0, err
		}
		if v, ok := strings.CutPrefix(comment, closedCommentPrefix); ok {
			p.before, _ = strconv.ParseInt(v, 10, 64)
		}
		out = append(out, p)
	}
	return out, now, rows.Err()
}

func (s postgres) groups(ctx context.Context, q dbx.Querier) ([]groupRow, error) {
	rows, err := q.Query(ctx, fmt.Sprintf(`SELECT "group_id", "last_xid"::text, "last_offset", "floor_offset" FROM %s`, s.t.Groups))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []groupRow
	for rows.Next() {
		var g groupRow
		var xid string
		if err := rows.Scan(&g.id, &xid, &g.pos.off, &g.floor); err != nil {
			return nil, err
		}
		if g.pos.xid, err = strconv.ParseUint(xid, 10, 64); err != nil {
			return nil, fmt.Errorf("last_xid %q: %w", xid, err)
		}
		out = append(out, g)
	}
	return out, rows.Err()
}

// detached lists the tables that were partitions of the messages table, detached by a pass
// that stopped before it dropped them: in the table's schema, named as its partitions are,
// marked closed, and no longer a partition.
func (s postgres) detached(ctx context.Context, q dbx.Querier) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT c.relname::text FROM pg_catalog.pg_class c
WHERE c.relnamespace = (SELECT p.relnamespace FROM pg_catalog.pg_class p WHERE p.oid = to_regclass($1))
  AND c.relkind = 'r' AND NOT c.relispartition AND left(c.relname, length($2)) = $2
  AND left(obj_description(c.oid, 'pg_class'), length($3)) = $3`, s.t.Messages, s.t.partStem()+"_p", closedCommentPrefix)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			return nil, err
		}
		out = append(out, name)
	}
	return out, rows.Err()
}

// heldPartitions returns the lower bounds of the partitions of ps that hold an offset of a
// claim row.
func (s postgres) heldPartitions(ctx context.Context, q dbx.Querier, ps []partition) (map[int64]bool, error) {
	los, his := make([]int64, len(ps)), make([]int64, len(ps))
	for i, p := range ps {
		los[i], his[i] = p.lo, p.hi
	}
	rows, err := q.Query(ctx, fmt.Sprintf(`SELECT DISTINCT b.lo FROM %s c, unnest(c."offsets") o,
	unnest($1::bigint[], $2::bigint[]) b(lo, hi)
WHERE o >= b.lo AND o < b.hi`, s.t.Claims), los, his)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	held := map[int64]bool{}
	for rows.Next() {
		var lo int64
		if err := rows.Scan(&lo); err != nil {
			return nil, err
		}
		held[lo] = true
	}
	return held, rows.Err()
}

// dropPartition detaches p without making claims or publishes wait (CONCURRENTLY; or
// completes a detach that was interrupted), counts its messages and drops it.
func (s postgres) dropPartition(ctx context.Context, c dbx.Querier, p partition) (int64, error) {
	t := s.t
	q := ident.Qualified(t.Schema, p.name)
	if p.pending {
		// Looked at before the count: a transaction that uses the partition may keep the
		// detach pending for minutes, and a pass runs every few seconds meanwhile.
		var used bool
		if err := dbx.QueryRow(ctx, c, `SELECT EXISTS (SELECT 1 FROM pg_locks l
			WHERE l.locktype = 'relation' AND l.relation = $1::regclass AND l.pid <> pg_backend_pid())`, []any{q}, &used); err != nil {
			return 0, fmt.Errorf("looking for sessions using partition %s: %w", q, err)
		}
		if used {
			return 0, errPartitionInUse
		}
	}
	switch {
	case p.detached:
	case p.pending:
		if _, err := c.Exec(ctx, `SELECT set_config('lock_timeout', $1, false)`, finalizeLockTimeout); err != nil {
			return 0, err
		}
		_, err := c.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s FINALIZE", t.Messages, q))
		if _, rerr := c.Exec(ctx, `SELECT set_config('lock_timeout', $1, false)`, detachLockTimeout); err == nil {
			err = rerr
		}
		if err != nil {
			return 0, fmt.Errorf("detaching partition %s: %w", q, err)
		}
	default:
		if _, err := c.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s CONCURRENTLY", t.Messages, q)); err != nil {
			return 0, fmt.Errorf("detaching partition %s: %w", q, err)
		}
	}
	// Counted once detached, not before: a detach that has to wait would count it again at
	// every pass.
	var n int64
	if err := dbx.QueryRow(ctx, c, fmt.Sprintf(`SELECT count(*) FROM %s`, q), nil, &n); err != nil {
		return 0, fmt.Errorf("counting the messages of partition %s: %w", q, err)
	}
	if _, err := c.Exec(ctx, "DROP TABLE "+q); err != nil {
		return 0, fmt.Errorf("dropping partition %s: %w", q, err)
	}
	return n, nil
}
