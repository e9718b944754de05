// Package sqlbroker is a Watermill Publisher and Subscriber over SQL tables: PostgreSQL, for
// pgx/v5 and database/sql, and in the lease mode SQLite through modernc.org/sqlite and MySQL or
// MariaDB through github.com/go-sql-driver/mysql.
//
// # Drivers
//
// Wrap the caller's pool with Pgx, StdSQL, SQLite or MySQL, or the caller's transaction with
// PgxTx, StdTx, SQLiteTx or MySQLTx to publish inside it. The library never closes a pool it
// was given. Open builds a Broker that owns its pool from a URL (postgres://, sqlite: or
// mysql://).
//
// # Delivery
//
// Delivery is at least once. A subscriber claims messages for its consumer group in one short
// statement and holds each with a lease (ClaimLease) that a loop extends while the handler
// runs; no transaction or connection is held meanwhile. Every ack, nack and extension is
// fenced by the claim's token: a consumer whose lease ran out cannot settle a message that
// went to another one. Messages are read in the order of the transactions that wrote them and
// only once every older transaction has ended, so a late commit is never skipped; the cost is
// that a long transaction anywhere in the cluster holds delivery back until it ends.
//
// # Consumer groups
//
// Every consumer group receives every message of a topic; within a group each message is
// worked by one consumer at a time. SubscriberConfig.MaxInFlight bounds how many of them one
// subscription has in handlers at once; it claims up to BatchSize more ahead (in advisory mode
// each with its lock).
//
// # Shutdown
//
// Cancelling the Subscribe context or calling Close stops a subscription, gives back the
// claims not yet handed to a handler and closes its channel. Shutdown returns a CloseReport
// of what it did.
//
// # Schema
//
// InitializeSchema creates the tables of a topic; SchemaSQL returns the same DDL for
// migration tools.
package sqlbroker
