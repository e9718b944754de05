package dbx

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"
)

// SQLState returns the PostgreSQL error code carried by err, from either driver, or "". On
// SQLite, an interrupted statement (InterruptedError) is CodeQueryCanceled and a missing
// table CodeUndefinedTable, so that callers branch on both databases alike.
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	if n := MySQLErrorNumber(err); n != 0 {
		return mysqlState(n)
	}
	var ie *InterruptedError
	if errors.As(err, &ie) {
		return CodeQueryCanceled
	}
	var se interface{ Code() int }
	if errors.As(err, &se) && se.Code()&0xff == sqliteError && strings.Contains(err.Error(), "no such table") {
		return CodeUndefinedTable
	}
	return ""
}

// sqliteError is SQLite's primary result code SQLITE_ERROR.
const sqliteError = 1

// Error codes the library branches on.
const (
	CodeUndefinedTable  = "42P01"
	CodeQueryCanceled   = "57014"
	CodeCheckViolation  = "23514" // also: no partition of a partitioned table takes the row
	CodeDeadlock        = "40P01"
	CodeUniqueViolation = "23505"
)

// StatementFailed reports whether err is the server's error for one statement (severity
// ERROR: a lock_timeout, a statement_timeout, a cancel, a constraint), after which the
// connection stays usable, as opposed to a connection that failed (a network error, a
// client-side timeout that made the driver close it, a FATAL from the server). A caller that
// needs to be sure can run a statement on the connection: it fails if the connection is gone.
func StatementFailed(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		sev := pgErr.SeverityUnlocalized
		if sev == "" {
			sev = pgErr.Severity
		}
		return sev == "ERROR"
	}
	if MySQLErrorNumber(err) != 0 {
		return true // an error packet of the server answers one statement
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		// Severity may be localised; a connection exception (class 08) is never one statement's.
		return !pqErr.Fatal() && pqErr.Severity != "PANIC" && !strings.HasPrefix(string(pqErr.Code), "08")
	}
	return false
}

// Error codes of a statement ended by the server's own bounds.
const (
	CodeLockNotAvailable = "55P03" // lock_timeout
)
