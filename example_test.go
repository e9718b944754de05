package sqlbroker_test

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// SchemaSQL gives a migration tool the statements that InitializeSchema would run.
func ExampleSchemaSQL() {
	ddl, err := sqlbroker.SchemaSQL("orders.created", "", "")
	if err != nil {
		panic(err)
	}
	for _, line := range strings.Split(ddl, "\n") {
		if strings.HasPrefix(line, "CREATE TABLE") {
			fmt.Println(line)
		}
	}
	// Output:
	// CREATE TABLE IF NOT EXISTS "sqlbroker_orders.created_messages" (
	// CREATE TABLE IF NOT EXISTS "sqlbroker_orders.created_groups" (
	// CREATE TABLE IF NOT EXISTS "sqlbroker_orders.created_claims" (
}

// A value the library refuses comes back as a ConfigError that names the field.
func ExampleConfigError() {
	_, err := sqlbroker.Open("mysql://user:secret@localhost", sqlbroker.BrokerConfig{}, watermill.NopLogger{}) // no database

	var cerr *sqlbroker.ConfigError
	if errors.As(err, &cerr) {
		fmt.Println("field:", cerr.Field)
		fmt.Println(strings.Contains(err.Error(), "secret"))
	}
	// Output:
	// field: url
	// false
}

// Topic and consumer group names are checked before they reach any SQL text.
func ExampleNameError() {
	_, err := sqlbroker.SchemaSQL("orders; DROP TABLE users", "", "")
	var nerr *sqlbroker.NameError
	if errors.As(err, &nerr) {
		fmt.Printf("%s %q refused\n", nerr.Field, nerr.Value)
	}
	// Output:
	// topic "orders; DROP TABLE users" refused
}
