package migrate

// The modules the snippets of the README and docs/ import beyond the library's own, required
// here so that the root package's TestDocs_snippetsCompile can build them in this module.
import (
	_ "github.com/ThreeDotsLabs/watermill/components/cqrs"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "modernc.org/sqlite"

	_ "github.com/sqlbroker/watermill-sqlbroker/sqlbrokerprom"
)
