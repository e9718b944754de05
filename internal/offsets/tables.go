// Package offsets holds the tables of a topic, their schema, and every statement that moves a
// consumer group through them: the group's position, claims, leases and settlements. It is the
// one place where the library's SQL text lives; the root package only calls it.
//
// A topic has three tables:
//
//   - messages: one row a published message, kept until retention deletes it, with the id of the transaction that
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
	"fmt"
	"strings"

	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// SchemaVersion is written into the messages table's comment and checked on start.
//
// Version 2 added the messages table's deliver_at column (delayed messages). SchemaSQL
// upgrades tables of version 1 in place (see upgradableVersion).
const SchemaVersion = 2

// upgradableVersion is the older schema version whose tables SchemaSQL upgrades: adding a
// nullable column without a default changes only the catalog, under a lock held for an
// instant, and leaves every row as it is (NULL: not delayed).
const upgradableVersion = 1

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

	sqlite bool // the tables of a SQLite database (OnSQLite)
}

// NewTables names the tables of topic. topic, schema and prefix must already be validated.
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

// SchemaSQL is the DDL for the topic's tables. It is idempotent (IF NOT EXISTS) and is what
// InitializeSchema runs; migration tools can take it as it is.
func (t Tables) SchemaSQL() string {
	if t.sqlite {
		return t.sqliteSchemaSQL()
	}
	var b strings.Builder
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"offset"     bigint      GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME %s),
	"xid"        xid8        NOT NULL DEFAULT pg_current_xact_id(),
	"uuid"       text        NOT NULL,
	"payload"    bytea       NOT NULL,
	"metadata"   jsonb       NOT NULL DEFAULT '{}',
	"created_at" timestamptz NOT NULL DEFAULT now(),
	"deliver_at" timestamptz,
	CONSTRAINT %s PRIMARY KEY ("offset")
);
`, t.Messages, t.seq("_m_seq"), t.obj("_m_pkey"))
	// Tables of schema version 1 lack deliver_at. The catalog is read first: ALTER TABLE takes
	// the table's ACCESS EXCLUSIVE lock even when the column exists, and this DDL also runs on
	// tables that are up to date (a migration tool running it again).
	body := fmt.Sprintf(` BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = %[1]s::regclass AND attname = 'deliver_at' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s ADD COLUMN IF NOT EXISTS "deliver_at" timestamptz;
	END IF;
END `, quoteLiteral(t.Messages), t.Messages)
	tag := dollarTag(body)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, body, tag)
	fmt.Fprintf(&b, "CREATE INDEX IF NOT EXISTS %s ON %s (\"xid\", \"offset\");\n", t.obj("_m_xid"), t.Messages)
	fmt.Fprintf(&b, "COMMENT ON TABLE %s IS '%s%d';\n", t.Messages, schemaCommentPrefix, SchemaVersion)
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"group_id"       integer     GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME %s),
	"consumer_group" text        NOT NULL,
	"last_xid"       xid8        NOT NULL,
	"last_offset"    bigint      NOT NULL,
	"updated_at"     timestamptz NOT NULL DEFAULT now(),
	CONSTRAINT %s PRIMARY KEY ("group_id"),
	CONSTRAINT %s UNIQUE ("consumer_group")
);
`, t.Groups, t.seq("_g_seq"), t.obj("_g_pkey"), t.obj("_g_name"))
	// The groups table names the topic, for tools that list topics from the catalog: a
	// shortened table name no longer spells it out.
	fmt.Fprintf(&b, "COMMENT ON TABLE %s IS %s;\n", t.Groups, quoteLiteral(topicCommentPrefix+t.Topic))
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"group_id"   integer     NOT NULL,
	"offset"     bigint      NOT NULL,
	"token"      bigint      NOT NULL,
	"visible_at" timestamptz NOT NULL,
	"attempts"   integer     NOT NULL,
	CONSTRAINT %s PRIMARY KEY ("group_id", "offset")
) WITH (fillfactor = 70);
`, t.Claims, t.obj("_c_pkey"))
	return b.String()
}

// dollarTag returns a dollar-quote tag ($sqlbroker$, or a longer one) that body does not
// contain. The body holds the table names, and a topic may contain $: the server ends a
// dollar-quoted string at the first occurrence of its tag, wherever it stands, inside quotes
// or not, so a topic spelling the tag would end the body early.
func dollarTag(body string) string {
	tag := "$sqlbroker$"
	for strings.Contains(body, tag) {
		tag = tag[:len(tag)-1] + "_$"
	}
	return tag
}
