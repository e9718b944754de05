package offsets

// PostgreSQL's claims: one row per claim statement, not per message.
//
// A row of the claims table holds the offsets that one claim statement took for a group and
// that are not yet settled ("offsets", an array in offset order), with what they share: the
// token they were claimed under, their attempt count and their lease deadline (visible_at).
// Its key is (group_id, token, attempts). Settling takes offsets out of their row (the row is
// deleted with its last offset); a nack or a release moves them into a row of their own, with
// no holder (a negative token, unique within the group) and the time they come due again. So
// every row version a statement writes carries many messages, and the dead versions a held
// snapshot keeps alive grow with the number of claim and settlement statements, not with the
// number of messages: at a batch of 100, about two versions per hundred messages instead of
// two per message.
//
// Fencing (L3) works on the row: a settlement finds the rows by their token through the
// primary key and changes only offsets still in the row of the token given. Taking a claim
// again gives it a new token, in a new row, so its former holder's token finds nothing.

import "fmt"

// unheldTokenSQL makes the token of a row no one holds: negative, so that it never matches a
// holder's token (those are positive), and random, so that rows made by concurrent statements
// have distinct keys without a shared sequence (which would need one more privilege).
const unheldTokenSQL = `(-1 - floor(random() * 4611686018427387903))::bigint`

// parkedTokenSQL makes the tokens of the parked rows that the ordered claim writes (m, its
// new messages of class 'p'): they lie below unheldTokenSQL's range (at most -2^62), after
// the group's latest parked row's and after every parked token the group ever had (the
// groups row's parked_top, which the claim that writes them moves up: parkedTopSQL), in the
// order the group's position passes the messages, so that a key's first parked message is its
// parked row of lowest token, found without reading the messages. The group's ordered claims
// run one after another (lockGroupRowSQL), so the tokens of one group are distinct and only
// grow: a group whose parked messages were all handed out does not start again at the bottom
// of the range, among the index entries of the rows handed out since the last vacuum, and no
// parked row is ever written below a floor a claim gave back (Store.ClaimOrderedFrom).
// Reaching the random range would take 2^62 messages parked.
const parkedTokenSQL = parkedBaseSQL + `
	+ row_number() OVER (ORDER BY m."xid", m."offset")`

// noParkFloorSQL is NoParkFloor, the lowest bigint, in SQL: below every token.
const noParkFloorSQL = `-9223372036854775808`

// parkedBaseSQL is the token the parked rows of a claim follow (parkedTokenSQL).
const parkedBaseSQL = `greatest(coalesce((SELECT pk.top FROM pk), ` + noParkFloorSQL + `), coalesce((SELECT g."parked_top" FROM g), ` + noParkFloorSQL + `))`

// parkedTopSQL is the groups row's parked_top once the claim wrote its parked rows: the
// highest token it gave one, or as it was when it parked none.
const parkedTopSQL = `CASE WHEN EXISTS (SELECT 1 FROM m WHERE m.cls = 'p')
		THEN ` + parkedBaseSQL + ` + (SELECT count(*) FROM m WHERE m.cls = 'p')
		ELSE "parked_top" END`

// mergeOffsetsSQL is the ON CONFLICT step of the inserts of held rows: a claim and a takeover
// of one round of the advisory mode may write the same token and attempt count.
const mergeOffsetsSQL = `ON CONFLICT ("group_id", "token", "attempts") DO UPDATE
	SET "offsets" = ARRAY(SELECT o FROM unnest(c."offsets" || excluded."offsets") o ORDER BY o),
		"visible_at" = excluded."visible_at"`

// givenBackSQL is the due step's filter of DueGivenBack: the rows no one holds. Their tokens
// are negative and the token is the second column of the primary key, so the step reads one
// range of the key, (group_id, < 0), whose entries come and go with nacks, releases, delayed
// and parked messages only: it reads no version of the rows of claims held and settled (all
// positive), and a held snapshot that keeps those alive costs it nothing.
const givenBackSQL = ` AND c."token" < 0`

// dueStepSQL is the due step of the claim statements: d0, the rows of group $1 that are due
// again (and match filter), lowest offsets first, locked unless another claimer has them;
// d1, their running count of offsets; due, one line per offset, up to limit in all (the last
// row reached may be taken in part). claims, cond and limit are placeholders of the caller's
// format (the names are never written into a format: a topic may hold a %).
func dueStepSQL(claims, filter, cond, limit string) string {
	return `d0 AS (
	SELECT c.ctid AS r, c."token", c."attempts", c."offsets" FROM ` + claims + ` c
	WHERE c."group_id" = $1 AND c."visible_at" <= now()` + filter + cond + sameVersionSQL(claims) + `
	ORDER BY c."offsets"[1] LIMIT ` + limit + `
	FOR UPDATE SKIP LOCKED
), ` + dueTailSQL(limit)
}

// sameVersionSQL is the due steps' condition that a row c locked is the version the
// statement's snapshot sees: FOR UPDATE locks a row's newest version and checks the
// conditions again on it, and a version written after the snapshot was taken (another
// claimer took part of the row, its holder settled or extended it) is one that the move out
// of its offsets (moveOutSQL), which changes rows by their address as of the snapshot, would
// not find. Such a row is left for the next claim. claims is a placeholder of the caller's
// format.
func sameVersionSQL(claims string) string {
	return `
	  AND c.ctid = (SELECT v.ctid FROM ` + claims + ` v WHERE v."group_id" = $1 AND v."token" = c."token" AND v."attempts" = c."attempts")`
}

// claimsLeaseIndexSQL is the index of the held claims' lease deadlines, read by DueRecent
// (dueRecentStepSQL): its key is leaseDeadlineSQL, the deadline of a held row (positive
// token) and NULL for a row no one holds. Its placeholders are its name and the claims table.
var claimsLeaseIndexSQL = `CREATE INDEX IF NOT EXISTS %s ON %s (` + leaseDeadlineSQL("") + `)`

// leaseDeadlineSQL is the key of the leases index: a row's lease deadline if someone holds it.
// A condition on it can be served by that index only: neither the primary key nor any other
// index of the claims table has it, so the planner cannot read the group's range of the key
// instead (which it may prefer, expecting a row or two of the group, and which holds every dead
// version). alias qualifies the columns when it is not "" (a row of the claims table as c:
// "c.").
func leaseDeadlineSQL(alias string) string {
	return `(CASE WHEN ` + alias + `"token" > 0 THEN ` + alias + `"visible_at" END)`
}

// recentWindowSQL is offsets.RecentWindow as an interval literal.
var recentWindowSQL = fmt.Sprintf("interval '%d milliseconds'", RecentWindow.Milliseconds())

// dueRecentStepSQL is dueStepSQL for DueGivenBack and DueRecent: d0 is the rows given back
// that are due (d0g, the negative tokens' range of the primary key) and, when the parameter
// recent is true (DueRecent), the held rows whose lease ran out within the last RecentWindow
// (d0l, a range of the leases index, claimsLeaseIndexSQL), each lowest offsets first and
// locked unless another claimer has them. The two looks are one statement, so that the rare
// one (once per IdlePollInterval) runs the prepared statement and the generic plan that the
// frequent one keeps on each connection: as a statement of its own, most of its runs were a
// connection's first five, each planned anew for its parameters, and planning this statement
// costs more than running it (BENCHMARKS.md). In the generic plan, the parameter is a filter
// run once, before the scan of d0l. d0l names its group as "group_id" + 0, which no index
// serves, so that the leases index is the only one its conditions can use (see
// leaseDeadlineSQL); the index holds the deadlines of every group of the topic, whose window
// it reads. A lease that ran out earlier is not read: the versions of the held claims settled
// while vacuum is held back lie at their deadlines in that index, and the window reads those
// of a few seconds only.
func dueRecentStepSQL(claims, cond, limit, recent string) string {
	return `d0g AS (
	SELECT c.ctid AS r, c."token", c."attempts", c."offsets" FROM ` + claims + ` c
	WHERE c."group_id" = $1 AND c."visible_at" <= now()` + givenBackSQL + cond + sameVersionSQL(claims) + `
	ORDER BY c."offsets"[1] LIMIT ` + limit + `
	FOR UPDATE SKIP LOCKED
), d0l AS (
	SELECT c.ctid AS r, c."token", c."attempts", c."offsets" FROM ` + claims + ` c
	WHERE ` + recent + `::boolean AND c."group_id" + 0 = $1 AND ` + leaseDeadlineSQL("c.") + ` <= now()
	  AND ` + leaseDeadlineSQL("c.") + ` > now() - ` + recentWindowSQL + cond + sameVersionSQL(claims) + `
	ORDER BY c."offsets"[1] LIMIT ` + limit + `
	FOR UPDATE SKIP LOCKED
), d0 AS (
	SELECT * FROM d0g UNION ALL SELECT * FROM d0l
), ` + dueTailSQL(limit)
}

// dueTailSQL is the end of the due steps, from d0 on: d1 and due.
func dueTailSQL(limit string) string {
	return `d1 AS (
	SELECT d0.*, sum(cardinality(d0."offsets")) OVER (ORDER BY d0."offsets"[1] ROWS UNBOUNDED PRECEDING) AS upto FROM d0
), due AS (
	SELECT x.o AS "offset", d1."token", d1."attempts" FROM d1,
	unnest(d1."offsets"[1 : least(cardinality(d1."offsets"), ` + limit + ` - (d1.upto - cardinality(d1."offsets")))::int]) x(o)
)`
}

// moveOutSQL takes the due offsets taken again (r, with their attempt counts one up) out of
// their rows (d1): mv groups them by row, rdel deletes a row left empty, rupd keeps the rest
// of the others. Both find the rows by their address (d1.r, the version the due step locked
// and the snapshot sees: sameVersionSQL), a TID scan: joined to mv by their key instead, the
// planner, which expects a row or two of the group, read every entry of the group's range of
// the key, with the dead versions a held snapshot keeps, at every claim that looked at the
// claims due again. Each runs only when it has a row to change: the planner may read a small
// claims table whole rather than by address, and most claims take nothing back. claims is a
// placeholder of the caller's format.
func moveOutSQL(claims string) string {
	return `mv AS (
	SELECT r."token", r."attempts" - 1 AS "attempts", array_agg(r."offset") AS gone FROM r GROUP BY r."token", r."attempts"
), mvr AS (
	SELECT d1.r, d1."offsets", mv.gone, cardinality(d1."offsets") = cardinality(mv.gone) AS whole
	FROM mv JOIN d1 ON d1."token" = mv."token" AND d1."attempts" = mv."attempts"
), rdel AS (
	DELETE FROM ` + claims + ` c WHERE EXISTS (SELECT 1 FROM mvr WHERE mvr.whole)
	  AND c.ctid = ANY (ARRAY(SELECT mvr.r FROM mvr WHERE mvr.whole))
), rupd AS (
	UPDATE ` + claims + ` c SET "offsets" = ARRAY(SELECT o FROM unnest(mvr."offsets") o WHERE o <> ALL (mvr.gone))
	FROM mvr
	WHERE EXISTS (SELECT 1 FROM mvr WHERE NOT mvr.whole)
	  AND c.ctid = ANY (ARRAY(SELECT mvr.r FROM mvr WHERE NOT mvr.whole)) AND c.ctid = mvr.r
)`
}

// unsizedArraySQL reads the bigint[] parameter p through a subquery, so that no plan knows its
// length: a plan made for the values given would count the elements, the generic plan guesses
// ten, and where the costs that follow scale with that count the generic plan looks dearer
// than the custom ones and the server plans the statement anew at every run.
func unsizedArraySQL(p string) string { return `(SELECT ` + p + `::bigint[])::bigint[]` }

// unlockStepSQL and unlockLinesSQL drop the session's locks of the offsets in $7 (settled
// claims' locks, whose drop the subscriber left to its next claim on the lock connection):
// unl unlocks each, and the last branch of the claim's result returns a line of kind 4 for
// each offset whose lock the session did not hold. The branch reads unl whole, and the claim
// reads every line of its result: the function runs once for every element of $7, whatever
// the claim took, after the locks the claim tried. A lock dropped here and taken again by the
// same statement (a nacked message due again at once) stays held once: session locks count
// their holds. $7 is read through a subquery, as $5 is (see cand).
const (
	unlockStepSQL = `, unl AS MATERIALIZED (
	SELECT u.o, pg_advisory_unlock($3::int4, (u.o::bit(32))::int4) AS held
	FROM unnest((SELECT $7::bigint[])::bigint[]) AS u(o)
)`
	unlockLinesSQL = `
	UNION ALL
	SELECT unl.o, '', ''::bytea, '{}'::jsonb, 0, 4, unl.o, 0::float8 FROM unl WHERE NOT unl.held`
)

// claimSQL builds the claim statements. One round trip claims up to $4 messages for group $1
// under token $2 (parameters: lease mode $3 the lease in ms, $5 the delayed messages it may
// pass; advisory mode $3 the lock key1, $5 the offsets whose locks the session holds already,
// $6 the delayed messages it may pass, $7 the offsets whose locks it drops, see
// unlockStepSQL; the statement of DueGivenBack and DueRecent takes one more, lease mode $6 and
// advisory mode $8: true for DueRecent, see dueRecentStepSQL):
//   - d0, d1, due (not with DueNone): rows of the group that are due again (with DueAll:
//     their lease ran out, with DueRecent: it ran out recently; with every look: they were
//     nacked or released and their backoff passed, or are delayed messages whose time came),
//     lowest offsets first; SKIP LOCKED leaves those another claimer is taking. due is one
//     line per offset, up to $4 in all: the last row it reaches may be taken in part.
//   - g: if that left room and a message is waiting, the group row, locked (it serialises the
//     group's claimers for a few milliseconds; an empty poll locks nothing, so it writes
//     nothing and takes no transaction id).
//   - m0, m: the next messages after the group's position that were written by transactions
//     older than every running one (M2); see newMessagesSQL.
//   - advisory mode only: cand, lk, the locks tried (see claimLockedSQL's comment in
//     advisory.go).
//   - mv, rdel, rupd: the due offsets taken (in the advisory mode, those whose lock was taken)
//     leave their rows: a row left empty is deleted, the others keep the rest.
//   - r: those offsets, one attempt more; ins: one row holding them and the new messages
//     claimed, under the token, with the lease (the advisory mode: 'infinity'), one per attempt
//     count; a row per delayed message, due at its time with no holder (attempt 0); in the
//     advisory mode, one row due at once for the new messages whose lock was not taken.
//   - advisory mode only: unl, the unlocks of $7, whose refusals are the result's last lines
//     (unlockStepSQL).
//   - upd and the final SELECT: see claimTailSQL.
//
// No parameter is used in an expression evaluated per row: the lease deadline is computed
// once, in a subquery. The server keeps a generic plan of a prepared statement only if it
// does not look dearer than the custom plans made with the parameters' values
// (TestClaimsKeepGenericPlans).
//
// with and cond are the asynchronous-commit prefix and condition of pgTopic.
func claimSQL(t Tables, with, cond string, due Due, locked bool) string {
	limit, pass, recent := "$4", "$5", "$6"
	held := `(SELECT clock_timestamp() + $3::float8 * interval '1 millisecond')`
	taken := `due`
	newHeld := `m WHERE m."later" IS NULL`
	if locked {
		pass, recent = "$6", "$8"
		held = `'infinity'::timestamptz`
		taken = `due, lk WHERE due."offset" = ANY (lk.os)`
		newHeld = `m, lk WHERE m."offset" = ANY (lk.os)`
	}
	var b []byte
	b = fmt.Appendf(b, "%s", with)
	switch due {
	case DueAll:
		b = fmt.Appendf(b, dueStepSQL("%[1]s", "", "%[2]s", "%[3]s"), t.Claims, cond, limit)
	case DueGivenBack, DueRecent:
		b = fmt.Appendf(b, dueRecentStepSQL("%[1]s", "%[2]s", "%[3]s", "%[4]s"), t.Claims, cond, limit, recent)
	default:
		b = append(b, `due AS (SELECT NULL::bigint AS "offset", NULL::bigint AS "token", NULL::integer AS "attempts" WHERE false)`...)
	}
	b = fmt.Appendf(b, `, g AS (
	SELECT gr."last_xid", gr."last_offset", gr."floor_offset" FROM %[1]s gr
	WHERE gr."group_id" = $1 AND (SELECT count(*) FROM due) < $4%[3]s
	  AND (`+nextWaitingSQL+`) IS NOT NULL
	FOR UPDATE
), `, t.Groups, t.Messages, cond)
	mat := ""
	if locked {
		mat = "MATERIALIZED "
	}
	b = fmt.Appendf(b, newMessagesSQL(mat, pass), "", t.Messages)
	if locked {
		b = append(b, `, cand AS MATERIALIZED (
	SELECT c.o FROM (
		SELECT "offset" AS o FROM due
		UNION ALL
		SELECT "offset" FROM m WHERE m."later" IS NULL
	) c
	WHERE c.o <> ALL (`+unsizedArraySQL("$5")+`)
), lk AS MATERIALIZED (
	SELECT coalesce(array_agg(o), '{}') AS os FROM cand
	WHERE pg_try_advisory_lock($3::int4, (o::bit(32))::int4)
)`...)
	}
	b = fmt.Appendf(b, `, r AS (
	SELECT due."offset", due."token", due."attempts" + 1 AS "attempts" FROM %s
)`, taken)
	if due != DueNone {
		b = fmt.Appendf(b, ", "+moveOutSQL("%[1]s"), t.Claims)
	}
	b = fmt.Appendf(b, `, ins AS (
	INSERT INTO %[1]s AS c ("group_id", "token", "attempts", "visible_at", "offsets")
	SELECT $1, $2::bigint, a.att, %[2]s, array_agg(a.o ORDER BY a.o) FROM (
		SELECT r."offset" AS o, r."attempts" AS att FROM r
		UNION ALL
		SELECT m."offset", 1 FROM %[3]s
	) a GROUP BY a.att
	UNION ALL
	SELECT $1, %[4]s, 0, m."later", ARRAY[m."offset"] FROM m WHERE m."later" IS NOT NULL`,
		t.Claims, held, newHeld, unheldTokenSQL)
	if locked {
		b = fmt.Appendf(b, `
	UNION ALL
	SELECT $1, %s, 0, now(), array_agg(m."offset" ORDER BY m."offset") FROM m, lk
	WHERE m."later" IS NULL AND m."offset" <> ALL (lk.os) HAVING count(*) > 0`, unheldTokenSQL)
	}
	b = append(b, "\n\t"+mergeOffsetsSQL+"\n)"...)
	more := ""
	if locked {
		b = append(b, unlockStepSQL...)
		more = unlockLinesSQL
	}
	b = fmt.Appendf(b, claimTailSQL(newHeld, more), t.Groups, t.Messages)
	return string(b)
}

// settleSQL builds the settlement statements of op: ack, nack, release and extend take group
// $1, offsets $2 and tokens $3 (pairs), and nack and extend the backoff or the lease in ms as
// $4. Dead-lettering is an ack that also copies the messages to another topic ($4 its name,
// $5 the group's, $6 and $7 the metadata keys dropped from the copy; to is its messages table).
//   - a: the pairs; k: for each token given, the group's rows of that token, found by their
//     own probe of the primary key (the LATERAL subquery, which FOR UPDATE keeps from being
//     flattened into a join, so that no plan reads more of the index than the keys given) and
//     locked in their newest version, whose offsets are checked (L3). The arrays are read
//     through unsizedArraySQL: once the claims table has statistics (an ANALYZE), the
//     generic plan's ten probes would otherwise look dearer than a single ack's one, and the
//     server would plan every settlement anew.
//   - hit: per row, the offsets of the pairs that are still in it (gone), and whether they are
//     all of them (whole).
//   - del, upd: the rows changed by row address: ack, nack, release and dead-lettering take
//     the offsets out (a row left empty is deleted); extend moves the lease. A row that a
//     concurrent statement (an extension, another settlement of the same claim) changed after
//     this statement's snapshot was taken is locked by k in its newer version, which del and
//     upd cannot see: its offsets are returned as fenced but not applied, and settle runs the
//     statement again for them (L3: a refusal means only that the claim is no longer the
//     delivery's).
//   - done: the offsets applied, with their attempt count; nack and release write them into
//     a row of their own with no holder, due after the backoff (release: at once, the attempt
//     they were counted as taken back).
//
// It returns one line (offset, applied) per pair whose token and offset matched a row.
func settleSQL(t Tables, with, cond string, op settleOp, to string) string {
	return settleStepsSQL(t, with, cond, op, to) + "\n" + settledLinesSQL
}

// settleStepsSQL is settleSQL's statement up to its result: its steps, ending with done.
func settleStepsSQL(t Tables, with, cond string, op settleOp, to string) string {
	var b []byte
	// The statement starts by naming its work, which pg_stat_activity shows within the first
	// kilobyte of its text (track_activity_query_size), where the rest would be cut.
	b = fmt.Appendf(b, "/* sqlbroker %s */ ", settleNames[op])
	b = fmt.Appendf(b, `%[2]sa AS (
	SELECT a.o, a.t FROM unnest(`+unsizedArraySQL("$2")+`, `+unsizedArraySQL("$3")+`) AS a(o, t)
), k AS (
	SELECT x.* FROM (SELECT DISTINCT a.t FROM a) tt,
	LATERAL (SELECT c.ctid AS r, c."token", c."attempts", c."offsets" FROM %[1]s c
		WHERE c."group_id" = $1 AND c."token" = tt.t
		FOR UPDATE) x
), hit AS (
	SELECT k.r, k."token", k."attempts", array_agg(DISTINCT a.o) AS gone,
		count(DISTINCT a.o) = cardinality(k."offsets") AS whole
	FROM k JOIN a ON a.t = k."token" AND a.o = ANY (k."offsets")
	GROUP BY k.r, k."token", k."attempts", k."offsets"
)`, t.Claims, with)
	if op == settleExtend {
		b = fmt.Appendf(b, `, ch AS (
	UPDATE %[1]s c SET "visible_at" = clock_timestamp() + $4::float8 * interval '1 millisecond'
	WHERE c.ctid = ANY (ARRAY(SELECT r FROM hit))%[2]s
	RETURNING c."token", c."attempts"
)`, t.Claims, cond)
	} else {
		b = fmt.Appendf(b, `, del AS (
	DELETE FROM %[1]s c
	WHERE c.ctid = ANY (ARRAY(SELECT r FROM hit WHERE whole))%[2]s
	RETURNING c."token", c."attempts"
), upd AS (
	UPDATE %[1]s c SET "offsets" = ARRAY(SELECT o FROM unnest(c."offsets") o
		WHERE o <> ALL (ARRAY(SELECT a.o FROM a WHERE a.t = c."token")))
	WHERE c.ctid = ANY (ARRAY(SELECT r FROM hit WHERE NOT whole))%[2]s
	RETURNING c."token", c."attempts"
), ch AS (
	SELECT * FROM del UNION ALL SELECT * FROM upd
)`, t.Claims, cond)
	}
	b = append(b, `, done AS (
	SELECT x.o, h."attempts" FROM hit h JOIN ch ON ch."token" = h."token" AND ch."attempts" = h."attempts",
	unnest(h.gone) x(o)
)`...)
	switch op {
	case settleNack, settleRelease:
		att, at := `done."attempts"`, `now() + $4::float8 * interval '1 millisecond'`
		if op == settleRelease {
			att, at = `greatest(done."attempts" - 1, 0)`, `now()`
		}
		b = fmt.Appendf(b, `, ins AS (
	INSERT INTO %[1]s ("group_id", "token", "attempts", "visible_at", "offsets")
	SELECT $1, %[2]s, %[3]s, %[4]s, array_agg(done.o ORDER BY done.o) FROM done GROUP BY %[3]s
)`, t.Claims, unheldTokenSQL, att, at)
	case settleDeadLetter:
		// The metadata keys the subscriber sets on a delivery (attempt, offset: $6, $7) are
		// dropped from the copy: the stored row carries them only if a publisher copied them
		// from an earlier delivery.
		b = fmt.Appendf(b, `, ins AS (
	INSERT INTO %[1]s ("uuid", "payload", "metadata")
	SELECT m."uuid", m."payload", (m."metadata" - $6::text - $7::text) || jsonb_build_object(
		'`+MetaDeadLetterTopic+`', $4::text, '`+MetaDeadLetterGroup+`', $5::text,
		'`+MetaDeadLetterAttempts+`', done."attempts"::text, '`+MetaDeadLetterOffset+`', m."offset"::text)
	FROM done, `+byOffsetSQL("m", "done.o")+`
	ORDER BY m."offset"
)`, to, t.Messages)
	}
	return string(b)
}

// settledLinesSQL is the result of settleSQL's statements: one line (offset, applied) per
// pair whose token and offset matched a row.
const settledLinesSQL = `SELECT x.o, EXISTS (SELECT 1 FROM done WHERE done.o = x.o) FROM hit, unnest(hit.gone) x(o)`

// parkedTokenMax is the highest token of a parked row (parkedTokenSQL): parked rows are the
// range of the claims table's key (group_id, token <= parkedTokenMax) of their group.
const parkedTokenMax = `-4611686018427387904`

// claimsParkedIndexSQL is the index of the parked rows by key, read by ackHandingOverSQL: a
// key's first parked message is its first entry, one lookup per key, where the range of the
// primary key holds every parked row of the group (and, while vacuum is held back, the dead
// versions of those parked since). Its placeholders are its name and the claims table.
const claimsParkedIndexSQL = `CREATE INDEX IF NOT EXISTS %s ON %s ("group_id", "order_key", "token") WHERE "token" <= ` + parkedTokenMax

// ackHandingOverSQL is the ack of a group ordered by key that hands each key it frees to the
// acker: settleSQL's ack (group $1, offsets $2, tokens $3), then, for each key of the
// messages it settled, the key's first parked message, claimed under token $4 with a lease
// of $5 ms, in the same statement. The key is free once its message is settled: at most one
// message of a key is unsettled and not parked (orderedClaimSQL), and this statement settled
// it. Claims and this statement agree on that without the group's lock: a claim's snapshot
// sees either the settled message and its successor held under $4 (the key busy again), or
// neither (the key busy with the message being settled); a parked row is moved only by a
// statement that saw its key free.
//   - ak: the keys of the messages settled;
//   - nx: each key's parked row of lowest token (its first in the group's order), the first
//     entry of the key in the parked rows' index (claimsParkedIndexSQL); a delayed message
//     whose time has not come is left to the claims, which make it due at its time;
//   - nd: those rows deleted, found by their address (a TID scan): only the ones deleted
//     here are handed over. Found by token instead, the generic plan read the group's whole
//     range of the primary key and filtered it by the tokens: every parked row, and the dead
//     versions of those parked since the last vacuum, at every ack. A parked row is never
//     updated, only deleted: one that another statement deleted meanwhile is skipped;
//   - their offsets written in one held row of token $4, attempt 1.
//
// Its lines: kind 0 for settledLinesSQL's (offset, applied), with an empty uuid, payload and
// metadata; then kind 1 (offset, true, uuid, payload, metadata) for each message handed over.
func ackHandingOverSQL(t Tables, with, cond string) string {
	// The steps are formatted already: never a format (a name may hold a %).
	return settleStepsSQL(t, with, cond, settleAck, "") + fmt.Sprintf(`, ak AS (
	SELECT `+orderKeySQL+` AS k, min(af.b) AS b
	FROM done JOIN unnest(`+unsizedArraySQL("$2")+`, `+unsizedArraySQL("$6")+`) AS af(o, b) ON af.o = done.o, `+byOffsetSQL("m", "done.o")+`
	WHERE m."metadata" ? '`+MetaOrderKey+`'
	GROUP BY 1
), nx AS (
	SELECT p.r, p.o FROM ak, LATERAL (
		SELECT c.ctid AS r, c."offsets"[1] AS o FROM %[1]s c
		WHERE c."group_id" = $1 AND c."order_key" = ak.k AND c."token" > ak.b AND c."token" <= `+parkedTokenMax+`
		ORDER BY c."token" LIMIT 1
	) p
), nd AS (
	DELETE FROM %[1]s c
	WHERE c.ctid = ANY (ARRAY(
		SELECT nx.r FROM nx, `+byOffsetSQL("m", "nx.o")+` WHERE (m."deliver_at" > now()) IS NOT TRUE))
	RETURNING c."offsets"[1] AS o, c."token" AS t
), nins AS (
	INSERT INTO %[1]s AS c ("group_id", "token", "attempts", "visible_at", "offsets")
	SELECT $1, $4::bigint, 1, clock_timestamp() + $5::float8 * interval '1 millisecond', array_agg(nd.o ORDER BY nd.o)
	FROM nd HAVING count(*) > 0
	`+mergeOffsetsSQL+`
)
SELECT 0, x.o, EXISTS (SELECT 1 FROM done WHERE done.o = x.o), '', ''::bytea, '', 0::bigint FROM hit, unnest(hit.gone) x(o)
UNION ALL
SELECT 1, m."offset", true, m."uuid", m."payload", m."metadata"::text, nd.t FROM nd, `+byOffsetSQL("m", "nd.o")+``, t.Claims, t.Messages)
}

// settleNames name the settlements in their statements' text.
var settleNames = map[settleOp]string{settleAck: "ack", settleNack: "nack", settleRelease: "release", settleExtend: "extend", settleDeadLetter: "dead letter"}

// heldSQL lists the offsets of group $1 held by a lock (rows with visible_at 'infinity')
// after offset $2, in offset order, leaving out the offsets in $3 (the caller's own
// deliveries), up to $4. The caller tries the locks of exactly these offsets (never
// pg_try_advisory_lock under a LIMIT, A4): a lock it can take belongs to a claim whose
// consumer is gone. It reads the group's held rows, as many as claim statements in work, and
// pages through their offsets from where the previous page ended, so every claim is looked at
// however many live ones come first. (Reading pg_locks instead costs a copy of the server's
// whole lock table per call: tens of milliseconds with a few thousand locks held.)
const heldSQL = `SELECT x.o FROM %s c, unnest(c."offsets") x(o)
WHERE c."group_id" = $1 AND c."visible_at" = 'infinity' AND c."token" > 0 AND x.o > $2
  AND x.o <> ALL ($3::bigint[])
ORDER BY x.o
LIMIT $4`

// adoptSQL takes over orphaned claims whose locks the caller now holds ($3), under its token
// ($2), one attempt more: their offsets leave their rows for a held row of the caller's. It
// runs after the locks were taken, so its snapshot sees every settlement that committed before
// the previous holder let go: a claim that was acked meanwhile is in no row, one that was
// nacked or released is in a row that is no longer 'infinity', and neither is returned (A4).
var adoptSQL = `WITH k AS (
	SELECT c.ctid AS r, c."token", c."attempts", c."offsets" FROM %[1]s c
	WHERE c."group_id" = $1 AND c."visible_at" = 'infinity' AND c."token" > 0 AND c."offsets" && $3::bigint[]
	FOR UPDATE
), hit AS (
	SELECT k.r, k."token", k."attempts", g.gone, cardinality(g.gone) = cardinality(k."offsets") AS whole
	FROM k, LATERAL (SELECT array_agg(o ORDER BY o) AS gone FROM unnest(k."offsets") o WHERE o = ANY ($3::bigint[])) g
	WHERE g.gone IS NOT NULL
), del AS (
	DELETE FROM %[1]s c WHERE c.ctid = ANY (ARRAY(SELECT r FROM hit WHERE whole))
	RETURNING c."token", c."attempts"
), upd AS (
	UPDATE %[1]s c SET "offsets" = ARRAY(SELECT o FROM unnest(c."offsets") o WHERE o <> ALL ($3::bigint[]))
	WHERE c.ctid = ANY (ARRAY(SELECT r FROM hit WHERE NOT whole))
	RETURNING c."token", c."attempts"
), done AS (
	SELECT x.o, h."attempts" + 1 AS "attempts" FROM hit h
	JOIN (SELECT * FROM del UNION ALL SELECT * FROM upd) ch ON ch."token" = h."token" AND ch."attempts" = h."attempts",
	unnest(h.gone) x(o)
), ins AS (
	INSERT INTO %[1]s AS c ("group_id", "token", "attempts", "visible_at", "offsets")
	SELECT $1, $2::bigint, done."attempts", 'infinity', array_agg(done.o ORDER BY done.o) FROM done GROUP BY done."attempts"
	` + mergeOffsetsSQL + `
)
SELECT m."offset", m."uuid", m."payload", m."metadata"::text, done."attempts", 0, 0::float8
FROM done, ` + byOffsetSQL("m", "done.o") + `
ORDER BY m."offset"`

// MetaOrderKey is the metadata key that holds a message's order key.
const MetaOrderKey = "sqlbroker_order_key"

// orderKeySQL is the order key of message m as a number: a 64-bit hash of the key's text, or
// NULL when the message has none. Two keys with the same hash are ordered together, as one.
const orderKeySQL = `CASE WHEN m."metadata" ? '` + MetaOrderKey + `' THEN hashtextextended(m."metadata" ->> '` + MetaOrderKey + `', 0) END`

// orderedClaimSQL is the lease mode's claim for a group ordered by key. Run it in a
// transaction that has locked the group's row first (lockGroupRowSQL): the claims of a group
// then run one after another, each with a snapshot taken after the one before committed, so
// that each sees every claim made before it. Settlements only take offsets out of rows; only
// claims decide which message of a key may go next.
//
// A message of a key goes to a handler only once every message of its key before it in the
// group's order is settled. So at most one message of a key is unsettled and not parked: held,
// due again, or delayed. The others wait in parked rows, one per message ("order_key" set,
// visible_at 'infinity', no holder), which the group's position passes as it passes delayed
// messages:
//   - cl, pk, busy: the group's rows; how many of them are parked, and the highest parked
//     token (read by the cap on parked rows, the choice of what m0 may pass, the new parked
//     rows' tokens and the bound of the messages claimed new); the keys of its unsettled
//     messages that are not parked (their metadata read by offset);
//   - due (as in claimSQL): offsets due again, which are first of their key by the above;
//   - h: parked messages first of their key (in the group's order: the lowest token of the
//     key's parked rows, parkedTokenSQL) whose key is not busy, up to the room the due ones
//     left, taken in the group's order; those whose time has not come (delayed) become a row
//     due at their time instead of being handed out. Only the messages of these few rows are
//     read, and their rows are deleted by their primary key (hdel), a step that does not run
//     when there are none: its generic plan reads the group's range of the key, every parked
//     row, and most claims hand out none;
//   - m0, m1, m: new messages, up to the room left plus those it may pass: a message with a
//     key is parked when its key is busy, has parked messages, or came earlier in this claim;
//     up to $6 parked rows, no new message is read, so that the parked ones, which every
//     claim reads, stay few. m0 reads as many messages as it may pass, whether it passes
//     them or not, and sorts them by key: it passes up to $7 when the group has parked
//     messages or, among the first room's worth of new messages (ahead, their keys only), a
//     key is busy or comes twice; otherwise its keys are seldom busy, and it passes only $5
//     (the delayed messages its caller allows). With many keys, a claim that read $7 more
//     messages to keep its room's worth spent most of its time reading them;
//   - the rows written as in claimSQL, and the parked ones.
//
// The leases it writes count from lt, a time taken once the statement runs, after the group's
// lock was had; each claimed line carries, in its last column, how many milliseconds lt came
// after the transaction's start (now()). The client knows a time before that start (before it
// sent the statement), and, adding those milliseconds, a time before the leases began: its
// deadlines never outlive them, and the wait for the group's lock does not shorten them.
//
// $1 group, $2 token, $3 the lease in ms, $4 the room, $5 the delayed messages it may pass
// while the group has no parked message, $6 the most parked messages the group keeps, $7 the
// delayed or parked messages it may pass while the group has some.
func orderedClaimSQL(t Tables, with, cond string) string {
	return fmt.Sprintf(`%[4]slt AS MATERIALIZED (
	SELECT clock_timestamp() AS "at"
), cl AS MATERIALIZED (
	SELECT c."token", c."attempts", c."offsets", c."order_key", c."visible_at" FROM %[3]s c
	WHERE c."group_id" = $1 AND c."token" > `+parkedTokenMax+`
	UNION ALL
	SELECT c."token", c."attempts", c."offsets", c."order_key", c."visible_at" FROM %[3]s c
	WHERE c."group_id" = $1 AND c."token" >= $8::bigint AND c."token" <= `+parkedTokenMax+`
), pk AS MATERIALIZED (
	SELECT count(*) AS n, max(cl."token") FILTER (WHERE cl."token" <= `+parkedTokenMax+`) AS top
	FROM cl WHERE cl."order_key" IS NOT NULL
), busy AS MATERIALIZED (
	SELECT DISTINCT `+orderKeySQL+` AS k
	FROM cl, unnest(cl."offsets") x(o), `+byOffsetSQL("m", "x.o")+`
	WHERE cl."order_key" IS NULL AND m."metadata" ? '`+MetaOrderKey+`'
), `+dueStepSQL("%[3]s", ` AND c."order_key" IS NULL`+orderedDueSQL, "%[5]s", "$4")+`, h0 AS (
	SELECT DISTINCT ON (cl."order_key") cl."token", cl."offsets"[1] AS o, cl."order_key" AS k
	FROM cl
	WHERE cl."order_key" IS NOT NULL AND cl."order_key" NOT IN (SELECT k FROM busy)
	ORDER BY cl."order_key", cl."token"
), h AS (
	SELECT h0."token", h0.o, h0.k, m."xid", CASE WHEN m."deliver_at" > now() THEN m."deliver_at" END AS later
	FROM h0, `+byOffsetSQL("m", "h0.o")+`
	ORDER BY m."xid", h0.o LIMIT greatest($4 - (SELECT count(*) FROM due), 0)
), hdel AS (
	DELETE FROM %[3]s c
	WHERE EXISTS (SELECT 1 FROM h)
	  AND c."group_id" = $1 AND c."token" >= $8::bigint AND c."token" = ANY (ARRAY(SELECT h."token" FROM h)) AND c."attempts" = 0
), room AS (
	SELECT $4 - (SELECT count(*) FROM due) - (SELECT count(*) FROM h WHERE h.later IS NULL) AS n
), g AS (
	SELECT gr."last_xid", gr."last_offset", gr."floor_offset", gr."parked_top" FROM %[1]s gr
	WHERE gr."group_id" = $1 AND (SELECT n FROM room) > 0
	  AND (SELECT pk.n FROM pk) < $6
	FOR UPDATE
), ahead AS MATERIALIZED (
	SELECT `+orderKeySQL+` AS k
	FROM %[2]s m
	WHERE `+newAfterGroupSQL+`
	ORDER BY m."xid", m."offset"
	LIMIT (SELECT n FROM room)
), m0 AS (
	SELECT m."offset", m."xid", m."uuid", m."payload", m."metadata", `+delayedSQL+` AS "later", `+orderKeySQL+` AS k
	FROM %[2]s m
	WHERE `+newAfterGroupSQL+`
	ORDER BY m."xid", m."offset"
	LIMIT (SELECT n FROM room) + CASE
		WHEN (SELECT pk.n FROM pk) > 0
		  OR EXISTS (SELECT 1 FROM ahead WHERE ahead.k IN (SELECT k FROM busy))
		  OR (SELECT count(ahead.k) > count(DISTINCT ahead.k) FROM ahead) THEN $7::bigint
		ELSE $5::bigint END
), m1 AS (
	SELECT m0.*, CASE
		WHEN m0.k IS NOT NULL AND (m0.k IN (SELECT k FROM busy) OR m0.k IN (SELECT cl."order_key" FROM cl WHERE cl."order_key" IS NOT NULL)
			OR row_number() OVER (PARTITION BY m0.k ORDER BY m0."xid", m0."offset") > 1) THEN 'p'
		WHEN m0."later" IS NOT NULL THEN 'd'
		ELSE 'c' END AS cls
	FROM m0
), m AS (
	SELECT w.* FROM (
		SELECT m1.*, count(*) FILTER (WHERE m1.cls = 'c') OVER (ORDER BY m1."xid", m1."offset" ROWS UNBOUNDED PRECEDING) AS nth FROM m1
	) w
	WHERE w.nth - (w.cls = 'c')::int < (SELECT n FROM room)
), r AS (
	SELECT due."offset", due."token", due."attempts" + 1 AS "attempts" FROM due
), `+moveOutSQL("%[3]s")+`, ins AS (
	INSERT INTO %[3]s AS c ("group_id", "token", "attempts", "visible_at", "offsets", "order_key")
	SELECT $1, $2::bigint, a.att, (SELECT lt."at" + $3::float8 * interval '1 millisecond' FROM lt), array_agg(a.o ORDER BY a.o), NULL::bigint FROM (
		SELECT r."offset" AS o, r."attempts" AS att FROM r
		UNION ALL
		SELECT h.o, 1 FROM h WHERE h.later IS NULL
		UNION ALL
		SELECT m."offset", 1 FROM m WHERE m.cls = 'c'
	) a GROUP BY a.att
	UNION ALL
	SELECT $1, `+unheldTokenSQL+`, 0, h.later, ARRAY[h.o], NULL FROM h WHERE h.later IS NOT NULL
	UNION ALL
	SELECT $1, `+unheldTokenSQL+`, 0, m."later", ARRAY[m."offset"], NULL FROM m WHERE m.cls = 'd'
	UNION ALL
	SELECT $1, `+parkedTokenSQL+`, 0, 'infinity', ARRAY[m."offset"], m.k FROM m WHERE m.cls = 'p'
), upd AS (
	UPDATE %[1]s SET "last_xid" = l."xid", "last_offset" = l."offset", "updated_at" = now(), "parked_top" = `+parkedTopSQL+`
	FROM (SELECT m."xid", m."offset" FROM m ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1) l
	WHERE "group_id" = $1
), ls AS (
	SELECT extract(epoch FROM lt."at" - now())::float8 * 1000 AS s FROM lt
)
SELECT x."offset", x."uuid", x."payload", x."metadata"::text, x."attempts", x.kind, x.at, x.after FROM (
	SELECT msg."offset", msg."uuid", msg."payload", msg."metadata", r."attempts", 0 AS kind, 0::bigint AS o1, r."offset" AS o2, (SELECT s FROM ls) AS at, 0::bigint AS after
	FROM r, `+byOffsetSQL("msg", `r."offset"`)+`
	UNION ALL
	SELECT msg."offset", msg."uuid", msg."payload", msg."metadata", 1, 1, 0, h.o, (SELECT s FROM ls), h."token"
	FROM h, `+byOffsetSQL("msg", "h.o")+` WHERE h.later IS NULL
	UNION ALL
	SELECT m."offset", m."uuid", m."payload", m."metadata", 1, 1, 1, row_number() OVER (ORDER BY m."xid", m."offset"), (SELECT s FROM ls), coalesce((SELECT pk.top FROM pk), 0)
	FROM m WHERE m.cls = 'c'
	UNION ALL
	SELECT x.o, '', ''::bytea, '{}'::jsonb, 0, 2, 0, x.o, extract(epoch FROM x.later)::float8 * 1000, 0
	FROM (SELECT h.o, h.later FROM h WHERE h.later IS NOT NULL UNION ALL SELECT m."offset", m."later" FROM m WHERE m.cls = 'd') x
	UNION ALL
	SELECT 0, '', ''::bytea, '{}'::jsonb, 0, 3, 0, 0, 0, CASE WHEN gt.top IS NULL THEN `+noParkFloorSQL+`
		ELSE coalesce((SELECT min(cl."token") FROM cl WHERE cl."token" <= `+parkedTokenMax+`), gt.top) END
	FROM (SELECT gr."parked_top" AS top FROM %[1]s gr WHERE gr."group_id" = $1) gt
) x ORDER BY x.kind, x.o1, x.o2`, t.Groups, t.Messages, t.Claims, with, cond)
}

// orderedDueSQL is the ordered claim's condition on its due step: that cl, the group's rows as
// the statement sees them, has a row due. The step reads the group's rows again, locking them,
// and its cost, like cl's, grows with the versions of the group's rows a vacuum has not yet
// removed; in a drain no row is due, and the step is left out.
const orderedDueSQL = `
	  AND EXISTS (SELECT 1 FROM cl WHERE cl."order_key" IS NULL AND cl."visible_at" <= now())`

// newAfterGroupSQL is the condition of the ordered claim's reads of new messages (ahead, m0):
// after the group's position (g), and written by transactions older than every running one.
const newAfterGroupSQL = `(m."xid", m."offset") > ((SELECT "last_xid" FROM g), (SELECT "last_offset" FROM g))
	  AND m."offset" >= (SELECT "floor_offset" FROM g)
	  AND m."xid" < pg_snapshot_xmin(pg_current_snapshot())`

// lockGroupRowSQL locks group $1's row until the transaction ends (see orderedClaimSQL).
const lockGroupRowSQL = `SELECT 1 FROM %s WHERE "group_id" = $1 FOR UPDATE`
