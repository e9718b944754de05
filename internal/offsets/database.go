package offsets

import (
	"context"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// database is the SQL of one database: every statement of a topic's tables whose text or steps
// differ between databases. Each implementation lives in the file named for its database
// (postgres.go, sqlite.go, mysql.go) and is picked once, by databaseOf, when the tables are named; the
// rest of the package never names a database.
type database interface {
	dialect() dbx.Dialect
	// tableName names a table of topic (see ident.TableName).
	tableName(prefix, topic, suffix string) string
	// quote quotes the table name for SQL text, schema-qualified when schema is not "".
	quote(schema, name string) string

	// Schema: the DDL of t, running it under the database's serialisation of creators
	// (upgrading tables of the version before), and checking existing tables (M7).
	schemaSQL(t Tables) string
	createIn(ctx context.Context, t Tables, tx dbx.Querier) error
	check(ctx context.Context, t Tables, q dbx.Querier, missingOK bool) error

	// prepare returns the database with the statements of t's topic made, for a Store; the
	// methods below run them. asyncCommit is NewStore's.
	prepare(t Tables, asyncCommit bool) database

	// Groups and claims.
	ensureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error)
	claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, out []Claimed) ([]Claimed, error)
	claimLocked(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit, pass int, key1 int32, skip, unlock []int64, due Due, out []Claimed) ([]Claimed, []int64, error)
	heldBack(ctx context.Context, q dbx.Querier, groupID int32) (int, error)
	// claimOrdered is claim for a group ordered by key, in a transaction of its own begun on
	// b; nil, ErrOrderUnsupported where the database has none. It also returns when the
	// transaction held the group's lock (see Store.ClaimOrdered), and reads and sets the
	// floor of the group's parked tokens (see Store.ClaimOrderedFrom).
	claimOrdered(ctx context.Context, b dbx.Beginner, groupID int32, token int64, ttl time.Duration, limit, pass int, floor *int64, out []Claimed) ([]Claimed, time.Time, error)

	// Settlements: ack, nack, release and extend (d is the backoff or the lease), and the move
	// of claims to another topic's messages table.
	settle(ctx context.Context, q dbx.Querier, op settleOp, groupID int32, fs []Fenced, d time.Duration) (map[int64]bool, error)
	// ackHandingOver is settle's ack for a group ordered by key that also claims, under token
	// with a lease of ttl, the first parked message of each key it frees, and returns them
	// (appended to out[:0]). A database that does not hand keys over returns none: its
	// ordered claims take the freed keys.
	ackHandingOver(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, token int64, ttl time.Duration, out []Claimed) (map[int64]bool, []Claimed, error)
	deadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to Tables, dropKeys [2]string) (map[int64]bool, error)

	// Writing messages. insertSQL writes n rows of 3 parameters (4 when delayed: the fourth
	// is deliverAt's value of the row's time, or nil), and with channel, where the database
	// has NOTIFY, notifies it in the same statement.
	insertSQL(n int, channel string, delayed bool) string
	// appending runs fn, which writes messages of the topic on the querier it is given, as
	// the database needs it: on MySQL in a transaction that holds the topic's head row (see
	// mysql.go), elsewhere on q as it is.
	appending(ctx context.Context, q dbx.Querier, fn func(dbx.Querier) error) error
	deliverAt(at time.Time) any
	notify(ctx context.Context, q dbx.Querier, channel, payload string) error

	// Partitions of the messages table and retention. addPartitions adds partitions for the next n
	// rows and noPartition says whether err refused a row for want of one (a database without
	// partitions does nothing and says no). maintain runs one pass of retention on the
	// connection c: on PostgreSQL it adds partitions, moves the groups' floors and drops the
	// partitions every group has passed (see postgres_partitions.go); on SQLite it deletes the
	// settled messages, a batch at a time.
	addPartitions(ctx context.Context, q dbx.Querier, n int) error
	noPartition(err error) bool
	maintain(ctx context.Context, st *partState, c dbx.Querier, opts MaintainOptions) (MaintainResult, error)

	// Messages as stored, for the Admin: the SELECT of ReadMessages (take false) or
	// TakeMessages (take true), and the deletion of messages with their claims.
	messagesSQL(t Tables, take bool) string
	deleteMessages(ctx context.Context, t Tables, tx dbx.Querier, offs []int64) (int64, error)

	// A key repository's table.
	keySchemaSQL(k KeyTable) string
	keyCreateIn(ctx context.Context, k KeyTable, tx dbx.Querier) error
	keyExists(ctx context.Context, k KeyTable, q dbx.Querier) (bool, error)
	keyClaim(ctx context.Context, k KeyTable, q dbx.Querier, key []byte, window time.Duration) (bool, error)
	keyPrune(ctx context.Context, k KeyTable, q dbx.Querier, limit int) (int64, error)

	// inspection is the database's operator statements (inspect.go), nil if it has none.
	inspection() *inspectStatements

	// backendAlive reports whether the server process pid still runs (BackendPIDs).
	backendAlive(ctx context.Context, q dbx.Querier, pid uint32) (bool, error)
}

// databaseOf picks the statements of the database d describes: the one place that does.
func databaseOf(d dbx.Dialect) database {
	switch d {
	case dbx.SQLite:
		return sqlite{}
	case dbx.MySQL:
		return mysql{}
	}
	return postgres{}
}

// settleOp is what a settlement does to the claims it matches.
type settleOp int

const (
	settleAck        settleOp = iota // delete them
	settleNack                       // make them visible again after the backoff
	settleRelease                    // make them visible at once, the attempt taken back
	settleExtend                     // move their lease deadline
	settleDeadLetter                 // delete them and copy their messages to another topic
)

// BackendAlive reports whether the server process pid (a connection's dbx.Conn.PID) still
// runs. Ask dbx.Dialect.BackendPIDs first: a database without server processes returns an
// error.
func BackendAlive(ctx context.Context, q dbx.Querier, pid uint32) (bool, error) {
	return databaseOf(dbx.DialectOf(q)).backendAlive(ctx, q, pid)
}
