package dbx

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"
)

// SQLState returns the PostgreSQL error code carried by err, from either driver, or "".
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return ""
}

// Error codes the library branches on.
const (
	CodeUndefinedTable = "42P01"
	CodeQueryCanceled  = "57014"
)
