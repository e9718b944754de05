package sqlbroker

import (
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// SchemaSQL returns the DDL that creates the tables of topic on PostgreSQL, for migration
// tools: the same statements InitializeSchema runs. schema is the PostgreSQL schema ("" for
// the search_path) and tablePrefix starts the table names ("" for DefaultTablePrefix); pass
// the values of the configs that will use the tables. The statements are idempotent. For
// SQLite, use SQLiteSchemaSQL.
func SchemaSQL(topic, schema, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.Postgres, topic, schema, tablePrefix)
	if err != nil {
		return "", err
	}
	return t.SchemaSQL(), nil
}

// SQLiteSchemaSQL is SchemaSQL for SQLite, which has no schemas: the DDL InitializeSchema
// runs on a SQLite database, idempotent. SQLite names the tables of a topic with an
// upper-case letter differently from PostgreSQL (SQLite compares table names without
// regard to case). SQLite tables written before delayed messages came to SQLite lack the
// messages table's deliver_at column, which InitializeSchema adds and these statements
// cannot (SQLite has no ADD COLUMN IF NOT EXISTS).
func SQLiteSchemaSQL(topic, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.SQLite, topic, "", tablePrefix)
	if err != nil {
		return "", err
	}
	return t.SchemaSQL(), nil
}

// MySQLSchemaSQL is SchemaSQL for MySQL and MariaDB, whose tables live in the connection's
// database: the DDL InitializeSchema runs there, idempotent. It names the tables of a topic as
// SQLiteSchemaSQL does (whether MySQL compares table names with regard to case depends on
// the server).
func MySQLSchemaSQL(topic, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.MySQL, topic, "", tablePrefix)
	if err != nil {
		return "", err
	}
	return t.SchemaSQL(), nil
}

// DropSQL returns the statements that drop the tables of topic on PostgreSQL (the messages
// table with its partitions and sequence) and the function that adds partitions to it, with
// the same arguments as SchemaSQL. Every message and consumer-group position of the topic is
// lost.
func DropSQL(topic, schema, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.Postgres, topic, schema, tablePrefix)
	if err != nil {
		return "", err
	}
	return t.DropSQL(), nil
}

// SQLiteDropSQL is DropSQL for SQLite: one statement a table, as SQLite drops one table at a
// time.
func SQLiteDropSQL(topic, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.SQLite, topic, "", tablePrefix)
	if err != nil {
		return "", err
	}
	return "DROP TABLE IF EXISTS " + t.Messages + ";\nDROP TABLE IF EXISTS " + t.Groups + ";\nDROP TABLE IF EXISTS " + t.Claims + ";\n", nil
}

// MySQLDropSQL is DropSQL for MySQL and MariaDB.
func MySQLDropSQL(topic, tablePrefix string) (string, error) {
	t, err := schemaTables(dbx.MySQL, topic, "", tablePrefix)
	if err != nil {
		return "", err
	}
	return "DROP TABLE IF EXISTS " + t.Messages + ", " + t.Groups + ", " + t.Claims + ";\n", nil
}

// schemaTables validates the arguments of SchemaSQL and names the tables on d.
func schemaTables(d dbx.Dialect, topic, schema, tablePrefix string) (offsets.Tables, error) {
	if tablePrefix == "" {
		tablePrefix = DefaultTablePrefix
	}
	if err := validateName("topic", topic); err != nil {
		return offsets.Tables{}, err
	}
	if err := validateIdentifier("Schema", schema, maxSchemaNameLength, true); err != nil {
		return offsets.Tables{}, err
	}
	if err := validateIdentifier("TablePrefix", tablePrefix, maxTablePrefixLength, false); err != nil {
		return offsets.Tables{}, err
	}
	return tablesOn(d, schema, tablePrefix, topic), nil
}
