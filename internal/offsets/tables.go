// Package offsets holds the tables of a topic, their schema, and every statement that moves a
// consumer group through them: the group's position, claims, leases and settlements. It is the
// one place where the library's SQL text lives; the root package only calls it.
//
// A topic has three tables:
//
//   - messages: one row a published message, kept until retention deletes it (on
//     PostgreSQL in partitions by offset range, dropped whole: postgres_partitions.go), with the id of the transaction that
//     wrote it (xid8). Read in (xid, offset) order and only below the oldest transaction still
//     running (pg_snapshot_xmin), so a message committed late is never skipped.
//   - groups: one row a consumer group, with the (xid, offset) position of the last message
//     handed out.
//   - claims: one small row a message of a group that was handed out and not yet settled, or
//     that waits for redelivery: (group_id, offset) key, fencing token, visible_at (the lease
//     deadline or the nack backoff), attempts. Ack deletes the row, so the table stays as small
//     as the work in flight and its updates stay HOT (no indexed column changes).
//
// A message published with a delay carries its time in the messages table's deliver_at. A
// group's claim of new messages passes it like any other, but writes its claim row due at that
// time with no holder (token 0, attempt 0), and hands it out no earlier than that: the claims
// due again take it then, and the messages behind it are not held back.
package offsets

import (
	"strconv"
	"strings"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// SchemaVersion is the version of PostgreSQL's tables, written into the messages table's
// comment and checked on start.
//
// Version 2 added the messages table's deliver_at column (delayed messages); version 3 made
// the claims table one row per claim statement instead of one per message; version 4 put the
// messages table in partitions by offset range (see postgres_partitions.go) and gave each
// group row the floor of the partitions it reads; version 5 added the claims table's index of
// lease deadlines (claimsLeaseIndexSQL). SchemaSQL upgrades tables of versions 1 to 4 in place
// (see upgradableVersions).
const SchemaVersion = 5

// SQLiteSchemaVersion is the version of SQLite's tables, written into the messages table's
// CREATE TABLE text. SQLite keeps one claim row per message: its single writer has no
// snapshot that would keep the versions of deleted rows alive.
const SQLiteSchemaVersion = 2

// upgradableVersions are the older schema versions of PostgreSQL's tables that SchemaSQL
// upgrades: version 1 lacks deliver_at (adding a nullable column without a default changes
// only the catalog, under a lock held for an instant, and leaves every row as it is: NULL,
// not delayed); versions 1 and 2 keep a claim row per message, which are moved into rows per
// claim; versions 1 to 3 keep the messages in one plain table, which becomes the first
// partition of the partitioned one; versions 1 to 4 lack the claims' index of lease deadlines,
// which is built (on a table of the claims in work: small, and locked against writes while it
// is built).
var upgradableVersions = []int{1, 2, 3, 4}

// schemaComment is the comment the messages table carries; the version is the last field.
const schemaCommentPrefix = "sqlbroker schema v"

// Tables are the quoted names of one topic's tables.
type Tables struct {
	Topic string

	// Schema is the PostgreSQL schema ("" = search_path).
	Schema string

	prefix string

	// Raw names, unquoted.
	MessagesName, GroupsName, ClaimsName string

	// Quoted, schema-qualified names for SQL text.
	Messages, Groups, Claims string

	db database // the database the tables are in (On)
}

// NewTables names the tables of topic on PostgreSQL (see On). topic, schema and prefix must
// already be validated.
func NewTables(schema, prefix, topic string) Tables {
	t := Tables{
		Topic:        topic,
		Schema:       schema,
		prefix:       prefix,
		MessagesName: ident.TableName(prefix, topic, "_messages"),
		GroupsName:   ident.TableName(prefix, topic, "_groups"),
		ClaimsName:   ident.TableName(prefix, topic, "_claims"),
	}
	t.Messages = ident.Qualified(schema, t.MessagesName)
	t.Groups = ident.Qualified(schema, t.GroupsName)
	t.Claims = ident.Qualified(schema, t.ClaimsName)
	return t
}

// On returns t for tables in a database of dialect d: that database's statements, and its
// table names (SQLite's differ for a topic with an upper-case letter: see ident.SQLiteTableName).
func (t Tables) On(d dbx.Dialect) Tables {
	t.db = databaseOf(d)
	t.MessagesName = t.db.tableName(t.prefix, t.Topic, "_messages")
	t.GroupsName = t.db.tableName(t.prefix, t.Topic, "_groups")
	t.ClaimsName = t.db.tableName(t.prefix, t.Topic, "_claims")
	t.Messages = t.db.quote(t.Schema, t.MessagesName)
	t.Groups = t.db.quote(t.Schema, t.GroupsName)
	t.Claims = t.db.quote(t.Schema, t.ClaimsName)
	return t
}

// OnSQLite is On(dbx.SQLite).
func (t Tables) OnSQLite() Tables { return t.On(dbx.SQLite) }

// Dialect says what the tables' database can do.
func (t Tables) Dialect() dbx.Dialect { return t.database().dialect() }

// database is the database of t: PostgreSQL unless On said otherwise.
func (t Tables) database() database {
	if t.db == nil {
		return postgres{}
	}
	return t.db
}

// obj names a dependent object (index, constraint, sequence) of the topic. Every one is named
// explicitly: PostgreSQL's own names for them are cut at 63 bytes, and two topics whose names
// share a long beginning would then race for the same name.
func (t Tables) obj(suffix string) string {
	return ident.Quote(ident.TableName(t.prefix, t.Topic, suffix))
}

// seq is like obj, schema-qualified, for sequences.
func (t Tables) seq(suffix string) string {
	return ident.Qualified(t.Schema, ident.TableName(t.prefix, t.Topic, suffix))
}

// partSuffixRoom is the longest suffix a partition's name or the name of one of its indexes
// gets after partStem: "_p", a lower bound of up to 20 characters, "_pkey".
const partSuffixRoom = "_p" + "-0000000000000000000" + "_pkey"

// partStem starts the name of every partition of the messages table (PostgreSQL): the
// partition of the offsets from lo is partStem + "_p" + lo, its indexes that name followed by
// "_pkey" and "_xid". It is cut and hashed as TableName cuts a table name, keeping room for
// the longest suffix, so that every such name fits in 63 bytes and stays the topic's own.
func (t Tables) partStem() string {
	return strings.TrimSuffix(ident.TableName(t.prefix, t.Topic, partSuffixRoom), partSuffixRoom)
}

// PartitionName is the name, unquoted, of the partition of the messages table (PostgreSQL)
// whose offsets start at lo; 0 names the one from MINVALUE, which a table of schema version 3
// or older became.
func (t Tables) PartitionName(lo int64) string {
	return t.partStem() + "_p" + strconv.FormatInt(lo, 10)
}

// extendFn is the schema-qualified name of the function that adds partitions to the messages
// table (PostgreSQL; see extendFnSQL).
func (t Tables) extendFn() string { return t.seq("_m_extend") }

// DropSQL drops the topic's tables (PostgreSQL): the messages table with its partitions and
// sequence, the groups and claims tables, and the function that adds partitions.
func (t Tables) DropSQL() string {
	return "DROP TABLE IF EXISTS " + t.Messages + ", " + t.Groups + ", " + t.Claims + ";\nDROP FUNCTION IF EXISTS " + t.extendFn() + "(bigint, bigint);\n"
}

// SchemaSQL is the DDL for the topic's tables. It is idempotent (IF NOT EXISTS) and is what
// InitializeSchema runs; migration tools can take it as it is.
func (t Tables) SchemaSQL() string { return t.database().schemaSQL(t) }
