package offsets

// PostgreSQL's operator statements (see inspect.go): they read pg_catalog, the xid horizon and
// the server's lock table.

// findSQL lists, in schema $1 ("" = the search_path) the tables whose names start with $2,
// with their comments, up to $3 rows. left() compares the prefix without LIKE, whose _ would
// match any character.
const findSQL = `SELECT n.nspname, c.relname, coalesce(obj_description(c.oid, 'pg_class'), '')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND left(c.relname, length($2)) = $2
  AND (n.nspname = $1 OR $1 = '' AND pg_catalog.pg_table_is_visible(c.oid))
  AND c.relname ~ '_(messages|groups|claims)$'
ORDER BY n.nspname, c.relname
LIMIT $3`

// inspectSQL reads every consumer group of the topic, up to $2, in one statement: each
// figure is a bounded index scan (the lag and the held-back messages stop at $1 rows, the
// claims at $1 rows of the group's key range, each a claim statement's unsettled offsets).
const inspectSQL = `SELECT g."consumer_group", g."last_offset",
	(SELECT count(*) FROM (SELECT 1 FROM %[1]s m
		WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset") AND m."offset" >= g."floor_offset" LIMIT $1) x),
	coalesce((SELECT max(m."offset") FROM %[1]s m), 0),
	cl.in_work, cl.waiting, cl.due, cl.parked,
	(SELECT count(*) FROM (SELECT 1 FROM %[1]s m
		WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset") AND m."offset" >= g."floor_offset"
		  AND m."xid" >= pg_snapshot_xmin(pg_current_snapshot()) LIMIT $1) x),
	coalesce(extract(epoch FROM now() - least(
		(SELECT m."created_at" FROM %[1]s m WHERE m."offset" = (SELECT min(x.o) FROM %[2]s c, unnest(c."offsets") x(o)
			WHERE c."group_id" = g."group_id")),
		(SELECT m."created_at" FROM %[1]s m
			WHERE (m."xid", m."offset") > (g."last_xid", g."last_offset") AND m."offset" >= g."floor_offset"
			ORDER BY m."xid", m."offset" LIMIT 1)))::float8, 0),
	extract(epoch FROM now() - g."updated_at")::float8
FROM %[3]s g,
LATERAL (SELECT
		coalesce(sum(cardinality(c."offsets")) FILTER (WHERE c."token" > 0 AND c."visible_at" > now()), 0) AS in_work,
		coalesce(sum(cardinality(c."offsets")) FILTER (WHERE c."token" <= 0 AND c."visible_at" > now() AND c."order_key" IS NULL), 0) AS waiting,
		coalesce(sum(cardinality(c."offsets")) FILTER (WHERE c."visible_at" <= now()), 0) AS due,
		coalesce(sum(cardinality(c."offsets")) FILTER (WHERE c."order_key" IS NOT NULL), 0) AS parked
	FROM (SELECT c."token", c."visible_at", c."offsets", c."order_key" FROM %[2]s c WHERE c."group_id" = g."group_id" LIMIT $1) c) cl
ORDER BY g."consumer_group"
LIMIT $2`

// claimsSQL lists claims one line per offset; a claim no one holds (a negative token) reads
// as token 0. Held advisory claims and parked ones both have no deadline ('infinity'); only
// parked ones have an order key.
const claimsSQL = `SELECT g."consumer_group", x.o, c."attempts", greatest(c."token", 0),
	c."visible_at" = 'infinity' AND c."order_key" IS NULL, c."order_key" IS NOT NULL,
	CASE WHEN c."visible_at" = 'infinity' THEN 0 ELSE extract(epoch FROM c."visible_at" - now())::float8 END
FROM %[1]s c JOIN %[2]s g ON g."group_id" = c."group_id", unnest(c."offsets") x(o)
ORDER BY g."consumer_group", x.o
LIMIT $1`

// resetFindOffsetSQL and resetFindTimeSQL find the first message kept at or after an offset,
// or written at or after a time; the group is then placed just before it. lastSQL finds the
// last message in the order of delivery, after which the group is placed when there is none,
// and the highest offset kept, below the offset of every message published later.
const (
	resetFindOffsetSQL = `SELECT m."xid"::text, m."offset" FROM %s m WHERE m."offset" >= $1 ORDER BY m."offset" LIMIT 1`
	resetFindTimeSQL   = `SELECT m."xid"::text, m."offset" FROM %s m WHERE m."created_at" >= $1 ORDER BY m."offset" LIMIT 1`
	lastSQL            = `SELECT m."xid"::text, m."offset", (SELECT max(x."offset") FROM %[1]s x) FROM %[1]s m ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1`
	lockGroupSQL       = `SELECT "group_id" FROM %s WHERE "consumer_group" = $1 FOR UPDATE`
	setGroupSQL        = `UPDATE %s SET "last_xid" = $2::text::xid8, "last_offset" = $3, "floor_offset" = 0, "updated_at" = now() WHERE "group_id" = $1`
	dropClaimsSQL      = `DELETE FROM %s WHERE "group_id" = $1`
	dropGroupSQL       = `DELETE FROM %s WHERE "group_id" = $1`
)

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

// advisoryHoldersSQL lists the message locks of the library (key1 in [$1, $2]) held in this
// database. It copies the server's whole lock table: for the command, not for a scrape.
const advisoryHoldersSQL = `SELECT l.classid::bigint, l.objid::bigint, l.pid::bigint
FROM pg_catalog.pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
  AND l.classid::bigint BETWEEN $1 AND $2`

// pgInspection are PostgreSQL's operator statements.
var pgInspection = &inspectStatements{
	find:            findSQL,
	inspect:         inspectSQL,
	claims:          claimsSQL,
	resetFindOffset: resetFindOffsetSQL,
	resetFindTime:   resetFindTimeSQL,
	last:            lastSQL,
	lockGroup:       lockGroupSQL,
	setGroup:        setGroupSQL,
	dropClaims:      dropClaimsSQL,
	dropGroup:       dropGroupSQL,
	horizon:         horizonSQL,
	advisoryHolders: advisoryHoldersSQL,
}

func (postgres) inspection() *inspectStatements { return pgInspection }
