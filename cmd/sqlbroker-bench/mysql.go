package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The MySQL contenders: the library's lease mode (sqlbroker.MySQL) and watermill-sql (its
// default MySQL schema and offsets adapter), each on a database/sql pool of
// github.com/go-sql-driver/mysql with -pool connections on -mysql-dsn, a fresh pool per
// scenario as on PostgreSQL. Both run on the same server, so the mysql contender's figures
// get their ratio to watermill-sql-mysql's. The server's CPU is not measured (it is found
// through PostgreSQL's pg_stat_activity), and the scenarios that read PostgreSQL's
// statistics are n/a, but for the hold (11), which reads InnoDB's counters instead, and
// retention (12), which reads the sizes of the tables' files (see mysqlFiles).

// openMySQLEnv opens a pool on cfg.mysqlDSN and connects all of it before anything is timed.
func openMySQLEnv(ctx context.Context, cfg *config, c contender) (*env, error) {
	std, err := sql.Open("mysql", cfg.mysqlDSN)
	if err != nil {
		return nil, fmt.Errorf("-mysql-dsn: %w", err)
	}
	std.SetMaxOpenConns(cfg.poolSize)
	std.SetMaxIdleConns(cfg.poolSize)
	if err := warmStd(ctx, std, cfg.poolSize); err != nil {
		_ = std.Close()
		return nil, fmt.Errorf("%s: connect to %s: %w", c, redactMySQL(cfg.mysqlDSN), err)
	}
	return &env{c: c, cfg: cfg, std: std, db: dbx.NewMySQLPool(std)}, nil
}

// drainedMySQL is drained on MySQL: for the library, no claim of the group left and its
// position at the last message; for watermill-sql, the last offset acked.
func (e *env) drainedMySQL(ctx context.Context, topic string) (bool, error) {
	var q string
	if e.c.isWatermillSQL() {
		q = fmt.Sprintf("SELECT coalesce((SELECT `offset_acked` FROM %s WHERE `consumer_group` = ?), -1)\n"+
			"\t= coalesce((SELECT max(`offset`) FROM %s), 0)",
			wsqlMySQLOffsets().MessagesOffsetsTable(topic), wsqlMySQLSchema().MessagesTable(topic))
	} else {
		t := e.tables(topic)
		q = fmt.Sprintf("WITH g AS (SELECT `group_id`, `last_offset` FROM %[2]s WHERE `consumer_group` = ?)\n"+
			"\tSELECT NOT EXISTS (SELECT 1 FROM %[1]s c, g WHERE c.`group_id` = g.`group_id`)\n"+
			"\tAND coalesce((SELECT `last_offset` FROM g), -1) = coalesce((SELECT max(`offset`) FROM %[3]s), 0)",
			t.Claims, t.Groups, t.Messages)
	}
	var ok int64
	err := e.std.QueryRowContext(ctx, q, group).Scan(&ok)
	return ok != 0, err
}

func dropMySQLTables(ctx context.Context, dsn string, tables []string) error {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return fmt.Errorf("drop tables: %w", err)
	}
	defer db.Close()
	var errs []error
	for _, t := range tables {
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t); err != nil {
			errs = append(errs, fmt.Errorf("drop %s: %w", t, err))
		}
	}
	return errors.Join(errs...)
}

// pingMySQL connects to dsn once, so that a run with a MySQL contender fails at its start
// when the server cannot be reached, rather than in every scenario.
func pingMySQL(ctx context.Context, dsn string) error {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return fmt.Errorf("-mysql-dsn: %w", err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("connect to %s: %w", redactMySQL(dsn), err)
	}
	return nil
}

// mysqlDescription names the server and its version, the driver and the settings that weigh
// on the figures, for the head of the output.
func mysqlDescription(dsn string) string {
	version, flush := "unknown", "unknown"
	if db, err := sql.Open("mysql", dsn); err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = db.QueryRowContext(ctx, "SELECT VERSION(), @@innodb_flush_log_at_trx_commit").Scan(&version, &flush)
		cancel()
		_ = db.Close()
	}
	server := "MySQL"
	if strings.Contains(version, "MariaDB") {
		server = "MariaDB"
	}
	return fmt.Sprintf("%s %s at %s (%s), innodb_flush_log_at_trx_commit=%s; the library's transactions run at READ COMMITTED, watermill-sql's subscriber's at SERIALIZABLE",
		server, version, redactMySQL(dsn), moduleVersion("github.com/go-sql-driver/mysql"), flush)
}

// redactMySQL is dsn without its password.
func redactMySQL(dsn string) string {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "(unparseable DSN)"
	}
	return fmt.Sprintf("%s@%s/%s", cfg.User, cfg.Addr, cfg.DBName)
}
