package offsets

// SQLite's operator statements (see inspect.go). They read sqlite_master and the topic's
// tables; SQLite has no transaction horizon and no advisory locks, so those statements are
// empty and their figures are reported as not applicable. Times are integer Unix
// milliseconds on SQLite's clock (sqliteNow); ages are returned in seconds, as PostgreSQL's.
//
// SQLite has no schemas: the schema parameter of the listing is "" and only carried through.

// sqliteFindSQL lists the tables whose names start with ?2, with the comment their CREATE
// TABLE statement carries (the text after "-- " on its first line: the schema version of a
// messages table, the topic of a groups table; see sqlite.schemaSQL), up to ?3 rows. ?1, the
// schema, is returned as the namespace of every row. substr() compares the prefix without
// LIKE, whose _ would match any character.
const sqliteFindSQL = `SELECT ?1, t."name",
	CASE WHEN instr(t."sql", '-- ') = 0 THEN '' ELSE
		substr(t."sql", instr(t."sql", '-- ') + 3,
			instr(substr(t."sql", instr(t."sql", '-- ') + 3) || char(10), char(10)) - 1) END
FROM sqlite_master t
WHERE t."type" = 'table' AND substr(t."name", 1, length(?2)) = ?2
  AND (t."name" LIKE '%\_messages' ESCAPE '\' OR t."name" LIKE '%\_groups' ESCAPE '\' OR t."name" LIKE '%\_claims' ESCAPE '\')
ORDER BY t."name"
LIMIT ?3`

// sqliteInspectSQL reads every consumer group of the topic, up to ?2, in one statement, with
// the columns of PostgreSQL's inspectSQL: each figure is a bounded scan (the lag stops at ?1
// rows, the claims at ?1 rows of the group's key range). A parked claim (sqliteParked) counts
// as parked, not as due. Nothing is held back on SQLite: offsets commit in order. The oldest
// unsettled message is the older of the group's claim with the lowest offset and the next
// message after its position (either may be missing). SQLite keeps one 'now' for the whole
// statement.
const sqliteInspectSQL = `SELECT g."consumer_group", g."last_offset",
	(SELECT count(*) FROM (SELECT 1 FROM %[1]s m WHERE m."offset" > g."last_offset" LIMIT ?1)),
	coalesce((SELECT max(m."offset") FROM %[1]s m), 0),
	(SELECT coalesce(sum(c."token" <> 0 AND c."visible_at" > ` + sqliteNow + `), 0)
		FROM (SELECT "token", "visible_at" FROM %[2]s WHERE "group_id" = g."group_id" LIMIT ?1) c),
	(SELECT coalesce(sum(c."token" = 0 AND c."visible_at" > ` + sqliteNow + `), 0)
		FROM (SELECT "token", "visible_at" FROM %[2]s WHERE "group_id" = g."group_id" LIMIT ?1) c),
	(SELECT coalesce(sum(c."visible_at" BETWEEN 0 AND ` + sqliteNow + `), 0)
		FROM (SELECT "visible_at" FROM %[2]s WHERE "group_id" = g."group_id" LIMIT ?1) c),
	(SELECT coalesce(sum(c."visible_at" < 0), 0)
		FROM (SELECT "visible_at" FROM %[2]s WHERE "group_id" = g."group_id" LIMIT ?1) c),
	0,
	coalesce((` + sqliteNow + ` - min(coalesce(g.claimed, g.next), coalesce(g.next, g.claimed))) / 1000.0, 0.0),
	(` + sqliteNow + ` - g."updated_at") / 1000.0
FROM (SELECT gr."group_id", gr."consumer_group", gr."last_offset", gr."updated_at",
		(SELECT m."created_at" FROM %[2]s c JOIN %[1]s m ON m."offset" = c."offset"
			WHERE c."group_id" = gr."group_id" ORDER BY c."offset" LIMIT 1) AS claimed,
		(SELECT m."created_at" FROM %[1]s m WHERE m."offset" > gr."last_offset" ORDER BY m."offset" LIMIT 1) AS next
	FROM %[3]s gr
	ORDER BY gr."consumer_group"
	LIMIT ?2) g
ORDER BY g."consumer_group"`

// sqliteClaimsSQL lists the claims of the topic: none is held by an advisory lock; a parked
// one has no deadline.
const sqliteClaimsSQL = `SELECT g."consumer_group", c."offset", c."attempts", c."token", 0, c."visible_at" < 0,
	CASE WHEN c."visible_at" < 0 THEN 0 ELSE (c."visible_at" - ` + sqliteNow + `) / 1000.0 END
FROM %[1]s c JOIN %[2]s g ON g."group_id" = c."group_id"
ORDER BY g."consumer_group", c."offset"
LIMIT ?1`

// The reset and deletion of a group. A position is the last offset handed out (offsets
// commit in order), so the "xid" the shared code carries is a constant. The write
// transaction of the library (BEGIN IMMEDIATE) holds the group as FOR UPDATE does on
// PostgreSQL. ResetGroup passes a time as the database stores it (deliverAt: Unix
// milliseconds).
const (
	sqliteResetFindOffsetSQL = `SELECT '0', m."offset" FROM %s m WHERE m."offset" >= ?1 ORDER BY m."offset" LIMIT 1`
	sqliteResetFindTimeSQL   = `SELECT '0', m."offset" FROM %s m WHERE m."created_at" >= ?1 ORDER BY m."offset" LIMIT 1`
	sqliteLastSQL            = `SELECT '0', m."offset", m."offset" FROM %s m ORDER BY m."offset" DESC LIMIT 1`
	sqliteLockGroupSQL       = `SELECT "group_id" FROM %s WHERE "consumer_group" = ?1`
	sqliteSetGroupSQL        = `UPDATE %s SET "last_offset" = ?3, "updated_at" = ` + sqliteNow + ` WHERE "group_id" = ?1 AND ?2 IS NOT NULL`
	sqliteDropClaimsSQL      = `DELETE FROM %s WHERE "group_id" = ?1`
	sqliteDropGroupSQL       = `DELETE FROM %s WHERE "group_id" = ?1`
)

// sqliteInspection are SQLite's operator statements. horizon and advisoryHolders are empty:
// SQLite has no transaction horizon (nothing is held back) and no advisory locks.
var sqliteInspection = &inspectStatements{
	find:            sqliteFindSQL,
	inspect:         sqliteInspectSQL,
	claims:          sqliteClaimsSQL,
	resetFindOffset: sqliteResetFindOffsetSQL,
	resetFindTime:   sqliteResetFindTimeSQL,
	last:            sqliteLastSQL,
	lockGroup:       sqliteLockGroupSQL,
	setGroup:        sqliteSetGroupSQL,
	dropClaims:      sqliteDropClaimsSQL,
	dropGroup:       sqliteDropGroupSQL,
}

func (sqlite) inspection() *inspectStatements { return sqliteInspection }
