package sqlbroker

import (
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/offsets"
)

// SchemaSQL returns the DDL that creates the tables of topic, for migration tools: the same
// statements InitializeSchema runs. schema is the PostgreSQL schema ("" for the search_path)
// and tablePrefix starts the table names ("" for DefaultTablePrefix); pass the values of the
// configs that will use the tables. The statements are idempotent.
func SchemaSQL(topic, schema, tablePrefix string) (string, error) {
	if tablePrefix == "" {
		tablePrefix = DefaultTablePrefix
	}
	if err := ident.ValidateName("topic", topic); err != nil {
		return "", err
	}
	if err := ident.ValidateIdentifier("Schema", schema, maxSchemaNameLength, true); err != nil {
		return "", err
	}
	if err := ident.ValidateIdentifier("TablePrefix", tablePrefix, maxTablePrefixLength, false); err != nil {
		return "", err
	}
	return offsets.NewTables(schema, tablePrefix, topic).SchemaSQL(), nil
}
