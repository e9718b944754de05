package sqlbroker

import (
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// SchemaSQL returns the DDL that creates the tables of topic, for migration tools: the same
// statements InitializeSchema runs. schema is the PostgreSQL schema ("" for the search_path)
// and tablePrefix starts the table names ("" for DefaultTablePrefix); pass the values of the
// configs that will use the tables. The statements are idempotent.
func SchemaSQL(topic, schema, tablePrefix string) (string, error) {
	if tablePrefix == "" {
		tablePrefix = DefaultTablePrefix
	}
	if err := validateName("topic", topic); err != nil {
		return "", err
	}
	if err := validateIdentifier("Schema", schema, maxSchemaNameLength, true); err != nil {
		return "", err
	}
	if err := validateIdentifier("TablePrefix", tablePrefix, maxTablePrefixLength, false); err != nil {
		return "", err
	}
	return offsets.NewTables(schema, tablePrefix, topic).SchemaSQL(), nil
}

// DropSQL returns the statement that drops the tables of topic, with the same arguments as
// SchemaSQL. Every message and consumer-group position of the topic is lost.
func DropSQL(topic, schema, tablePrefix string) (string, error) {
	if _, err := SchemaSQL(topic, schema, tablePrefix); err != nil {
		return "", err
	}
	if tablePrefix == "" {
		tablePrefix = DefaultTablePrefix
	}
	t := offsets.NewTables(schema, tablePrefix, topic)
	return "DROP TABLE IF EXISTS " + t.Messages + ", " + t.Groups + ", " + t.Claims, nil
}
