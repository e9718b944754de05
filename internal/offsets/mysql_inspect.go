package offsets

// MySQL's operator statements (see inspect.go). They read information_schema and the topic's
// tables; MySQL, like SQLite, has no transaction horizon that holds delivery back (offsets
// commit in order) and no advisory locks, so those statements are empty and their figures are
// reported as not applicable. Times are Unix milliseconds on the server's clock (mysqlNow);
// ages are returned in seconds.
//
// MySQL's placeholders are positional and each is bound once: a value a statement reads more
// than once comes from a derived table of the parameters (p), in the order the shared code
// passes them; a LIMIT takes a placeholder only, so it keeps one of its own, last.

// mysqlFindSQL lists the tables of the connection's database whose names start with the
// prefix (compared byte by byte: information_schema compares without regard to case), with
// their comments (the schema version of a messages table, the topic of a groups table), up to
// the limit. The schema, "" on MySQL, is returned as the namespace of every row.
const mysqlFindSQL = "SELECT p.s, t.TABLE_NAME, t.TABLE_COMMENT\n" +
	"FROM (SELECT ? AS s, CAST(? AS BINARY) AS pre) p\n" +
	"JOIN information_schema.TABLES t ON t.TABLE_SCHEMA = DATABASE()\n" +
	"WHERE CAST(LEFT(t.TABLE_NAME, CHAR_LENGTH(p.pre)) AS BINARY) = p.pre\n" +
	"  AND (RIGHT(t.TABLE_NAME, 9) = '_messages' OR RIGHT(t.TABLE_NAME, 7) = '_groups' OR RIGHT(t.TABLE_NAME, 7) = '_claims')\n" +
	"ORDER BY t.TABLE_NAME\n" +
	"LIMIT ?"

// mysqlInspectSQL reads every consumer group of the topic (the head row aside), up to the
// second parameter, with the columns of PostgreSQL's inspectSQL. The lag counts the messages
// of the offsets that follow the position, up to the cap (a range of the primary key); past
// the cap it reports the cap, and the caller estimates it from the newest offset. A claims row
// counts its offsets: held with a lease to come, waiting with no holder and a time to come,
// or due. Nothing is parked (no order by key) and nothing held back.
const mysqlInspectSQL = "SELECT g.`consumer_group`, g.`last_offset`,\n" +
	"\tCASE WHEN g.newest > g.`last_offset` + p.cap THEN p.cap ELSE\n" +
	"\t\t(SELECT count(*) FROM %[1]s m WHERE m.`offset` > g.`last_offset` AND m.`offset` <= g.`last_offset` + p.cap) END,\n" +
	"\tg.newest,\n" +
	"\t(SELECT coalesce(sum(LENGTH(c.`offsets`) DIV 8), 0) FROM %[2]s c WHERE c.`group_id` = g.`group_id` AND c.`token` > 0 AND c.`visible_at` > g.now),\n" +
	"\t(SELECT coalesce(sum(LENGTH(c.`offsets`) DIV 8), 0) FROM %[2]s c WHERE c.`group_id` = g.`group_id` AND c.`token` < 0 AND c.`visible_at` > g.now),\n" +
	"\t(SELECT coalesce(sum(LENGTH(c.`offsets`) DIV 8), 0) FROM %[2]s c WHERE c.`group_id` = g.`group_id` AND c.`visible_at` <= g.now),\n" +
	"\t0, 0,\n" +
	"\tcoalesce((g.now - LEAST(coalesce(\n" +
	"\t\t(SELECT m.`created_at` FROM %[1]s m WHERE m.`offset` = (SELECT min(c.`first_offset`) FROM %[2]s c WHERE c.`group_id` = g.`group_id`)),\n" +
	"\t\t(SELECT m.`created_at` FROM %[1]s m WHERE m.`offset` > g.`last_offset` ORDER BY m.`offset` LIMIT 1)),\n" +
	"\t\tcoalesce((SELECT m.`created_at` FROM %[1]s m WHERE m.`offset` > g.`last_offset` ORDER BY m.`offset` LIMIT 1),\n" +
	"\t\t(SELECT m.`created_at` FROM %[1]s m WHERE m.`offset` = (SELECT min(c.`first_offset`) FROM %[2]s c WHERE c.`group_id` = g.`group_id`))))) / 1000.0, 0.0),\n" +
	"\t(g.now - g.`updated_at`) / 1000.0\n" +
	"FROM (SELECT ? AS cap) p\n" +
	"JOIN (SELECT gr.`group_id`, gr.`consumer_group`, gr.`last_offset`, gr.`updated_at`, " + mysqlNow + " AS now,\n" +
	"\t\tcoalesce((SELECT max(m.`offset`) FROM %[1]s m), 0) AS newest\n" +
	"\tFROM %[3]s gr WHERE gr.`consumer_group` <> ''\n" +
	"\tORDER BY gr.`consumer_group`\n" +
	"\tLIMIT ?) g\n" +
	"ORDER BY g.`consumer_group`"

// mysqlDigits numbers 0 to 9999 without a recursive CTE (MySQL bounds their depth at 1000):
// the offsets of a claims row, packed 8 bytes each, are read at these positions.
const mysqlDigits = "(SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS i FROM " +
	"(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) a, " +
	"(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) b, " +
	"(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) c, " +
	"(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) e)"

// mysqlClaimsSQL lists the claims of the topic, one line per offset of each claims row: none
// is held by an advisory lock or parked.
const mysqlClaimsSQL = "SELECT g.`consumer_group`, CAST(CONV(HEX(SUBSTRING(c.`offsets`, 8 * n.i + 1, 8)), 16, 10) AS SIGNED) AS o,\n" +
	"\tc.`attempts`, c.`token`, 0, 0, (c.`visible_at` - " + mysqlNow + ") / 1000.0\n" +
	"FROM %[1]s c JOIN %[2]s g ON g.`group_id` = c.`group_id` JOIN " + mysqlDigits + " n ON n.i < LENGTH(c.`offsets`) DIV 8\n" +
	"ORDER BY g.`consumer_group`, o\n" +
	"LIMIT ?"

// The reset and deletion of a group. A position is the last offset handed out (offsets
// commit in order), so the "xid" the shared code carries is a constant. The group's row is
// locked for the transaction; ResetGroup passes a time as the database stores it (deliverAt:
// Unix milliseconds). setGroup takes (group id, xid, offset) and sets the offset only when
// xid is not NULL, as on the other databases.
const (
	mysqlResetFindOffsetSQL = "SELECT '0', m.`offset` FROM %s m WHERE m.`offset` >= ? ORDER BY m.`offset` LIMIT 1"
	mysqlResetFindTimeSQL   = "SELECT '0', m.`offset` FROM %s m WHERE m.`created_at` >= ? ORDER BY m.`offset` LIMIT 1"
	mysqlLastSQL            = "SELECT '0', m.`offset`, m.`offset` FROM %s m ORDER BY m.`offset` DESC LIMIT 1"
	mysqlLockGroupSQL       = "SELECT `group_id` FROM %s WHERE `consumer_group` = ? AND `consumer_group` <> '' FOR UPDATE"
	mysqlSetGroupSQL        = "UPDATE %s g JOIN (SELECT ? AS id, ? AS x, ? AS pos) p ON g.`group_id` = p.id AND p.x IS NOT NULL\n" +
		"SET g.`last_offset` = p.pos, g.`updated_at` = " + mysqlNow
	mysqlDropClaimsSQL = "DELETE FROM %s WHERE `group_id` = ?"
	mysqlDropGroupSQL  = "DELETE FROM %s WHERE `group_id` = ?"
)

// mysqlInspection are MySQL's operator statements. horizon and advisoryHolders are empty.
var mysqlInspection = &inspectStatements{
	find:            mysqlFindSQL,
	inspect:         mysqlInspectSQL,
	claims:          mysqlClaimsSQL,
	resetFindOffset: mysqlResetFindOffsetSQL,
	resetFindTime:   mysqlResetFindTimeSQL,
	last:            mysqlLastSQL,
	lockGroup:       mysqlLockGroupSQL,
	setGroup:        mysqlSetGroupSQL,
	dropClaims:      mysqlDropClaimsSQL,
	dropGroup:       mysqlDropGroupSQL,
}

func (mysql) inspection() *inspectStatements { return mysqlInspection }
