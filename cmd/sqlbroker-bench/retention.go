package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Scenario 12, retention: -retention-n messages offered at -retention-rate to one topic,
// consumed by one subscriber with Retention -retention (1 s by default), and the sizes of
// the topic's tables every second (pg_total_relation_size, the messages table's summed over
// its partitions): what the tables hold must follow what is unsettled and retained, not what
// has passed through. After the last message is handled, it waits up to -retention-settle for
// retention to drop what it can, and prints the sizes at the peak and at the end. Dropped
// partitions need no vacuum; the claims table's deleted rows do: on a server whose autovacuum
// is off, -retention-vacuum D vacuums the claims and groups tables every D in its stead.
//
// On SQLite (one table, retention deletes row by row) it prints the database file's size and
// its WAL's, the pages in use (the file's, less its free list: deleted rows free pages that
// SQLite reuses, without VACUUM) and the messages table's rows.
//
// On MySQL (retention deletes windows of offsets) it prints the sizes of the messages and
// claims tables' files (see mysqlFiles: information_schema's sizes of InnoDB tables are
// estimates, refreshed only with their statistics) and the messages table's rows.
func scenarioRetention(ctx context.Context, b *bench, c contender) error {
	if c.isWatermillSQL() {
		return fmt.Errorf("%w: watermill-sql has no retention", errNA)
	}
	cfg := b.cfg
	e, topic, err := b.prepare(ctx, c, "retention", 0)
	if err != nil {
		return err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	tables := e.tables(topic)
	var files *mysqlFiles
	if c.onMySQL() {
		if files, err = openMySQLFiles(ctx, e.std, tables.MessagesName, tables.ClaimsName); err != nil {
			return err
		}
	}
	pub, err := e.publisher()
	if err != nil {
		return err
	}
	defer pub.Close()
	var sub message.Subscriber
	if c.onSQLite() {
		sub, err = e.broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "retention", Retention: cfg.retention})
	} else {
		sub, err = e.poolSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "retention", Retention: cfg.retention})
	}
	if err != nil {
		return err
	}
	defer sub.Close()
	var handled atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddConsumerHandler("retention", topic, sub, func(*message.Message) error {
		handled.Add(1)
		return nil
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(runCtx) }()
	defer func() {
		_ = router.Close()
		select {
		case <-runErr:
		case <-time.After(30 * time.Second):
			b.logf("retention, %s: router did not stop within 30s of Close", c)
		}
	}()
	select {
	case <-router.Running():
	case err := <-runErr:
		runErr <- err
		return fmt.Errorf("router stopped before running: %v", err)
	case <-time.After(30 * time.Second):
		return errors.New("router did not start within 30s")
	}

	fmt.Printf("## Scenario 12, retention: %s, %d messages of %d B offered at %d msg/s to one subscriber with Retention %s\n\n",
		c, cfg.retentionN, cfg.payloadSize, cfg.retentionRate, cfg.retention)
	switch {
	case c.onSQLite():
		fmt.Printf("Sizes: the database file and its WAL on disk; in use, the file's pages less those on its free list (pages that deleted rows freed, which SQLite reuses for new rows); tables: the messages table's rows. No VACUUM.\n\n")
		fmt.Printf("%5s %10s %10s %8s | %12s %12s %12s | %10s\n", "t", "published", "handled", "lag", "file", "WAL", "in use", "rows")
	case c.onMySQL():
		fmt.Printf("Sizes: each table's file of its own (innodb_file_per_table), the messages table's %s; %s. InnoDB never shrinks a file by itself: "+
			"the pages of the rows that retention deletes are reused for new rows once purge has removed them (no OPTIMIZE TABLE). "+
			"rows: the messages table's, count(*).\n\n", files.paths[0], files.source)
		fmt.Printf("%5s %10s %10s %8s | %12s %12s | %10s\n", "t", "published", "handled", "lag", "messages", "claims", "rows")
	default:
		var autovacuum string
		if err := b.admin.QueryRow(ctx, `SELECT current_setting('autovacuum')`).Scan(&autovacuum); err != nil {
			return err
		}
		vacuum := "left to autovacuum (" + autovacuum + ")"
		if cfg.retentionVacuum > 0 {
			vacuum = fmt.Sprintf("VACUUM every %s", cfg.retentionVacuum)
		}
		fmt.Printf("Sizes: pg_total_relation_size (table, indexes, TOAST), the messages table summed over its partitions. Claims and groups tables: %s.\n\n", vacuum)
		fmt.Printf("%5s %10s %10s %8s | %12s %10s | %12s\n", "t", "published", "handled", "lag", "messages", "partitions", "claims")
	}

	start := time.Now()
	p := startPacer(runCtx, pub, topic, cfg.retentionRate, b.payload, 0)
	stopped := false
	stopPacer := func() {
		if !stopped {
			stopped = true
			p.stop()
		}
	}
	defer stopPacer()
	var peakMsgs, peakClaims, lastMsgs, lastClaims, peakRows, lastRows int64
	var doneAt, vacuumed time.Time
	// settled says that the pacer stopped, every message published was handled, and the
	// tables have had cfg.retentionSettle since to shrink: the run ends.
	settled := func(published, h int64) bool {
		if !stopped || h < published {
			return false
		}
		if doneAt.IsZero() {
			doneAt = time.Now()
		}
		return time.Since(doneAt) >= cfg.retentionSettle
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case err := <-runErr:
			runErr <- err
			return fmt.Errorf("router stopped early: %v", err)
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		if perr := p.failed(); perr != nil {
			return perr
		}
		published, h := p.published.Load(), handled.Load()
		if published >= int64(cfg.retentionN) {
			stopPacer()
			published = p.published.Load()
		}
		if c.onSQLite() {
			st, err := e.sqliteSizes(ctx, topic)
			if err != nil {
				return fmt.Errorf("read the sizes: %w", err)
			}
			peakMsgs, peakClaims, lastMsgs, lastClaims = max(peakMsgs, st.file+st.wal), max(peakClaims, st.inUse), st.file+st.wal, st.inUse
			peakRows = max(peakRows, st.rows)
			fmt.Printf("%5.0f %10d %10d %8d | %8.1f MiB %8.1f MiB %8.1f MiB | %10d\n", time.Since(start).Seconds(), published, h, published-h,
				mib(uint64(st.file)), mib(uint64(st.wal)), mib(uint64(st.inUse)), st.rows)
			if settled(published, h) {
				break
			}
			continue
		}
		if c.onMySQL() {
			sizes, err := files.sizes(ctx)
			if err != nil {
				return fmt.Errorf("read the sizes: %w", err)
			}
			var rows int64
			if err := e.std.QueryRowContext(ctx, "SELECT count(*) FROM "+tables.Messages).Scan(&rows); err != nil {
				return fmt.Errorf("count the messages table's rows: %w", err)
			}
			peakMsgs, peakClaims, lastMsgs, lastClaims = max(peakMsgs, sizes[0]), max(peakClaims, sizes[1]), sizes[0], sizes[1]
			peakRows, lastRows = max(peakRows, rows), rows
			fmt.Printf("%5.0f %10d %10d %8d | %8.1f MiB %8.2f MiB | %10d\n", time.Since(start).Seconds(), published, h, published-h,
				mib(uint64(sizes[0])), mib(uint64(sizes[1])), rows)
			if settled(published, h) {
				break
			}
			continue
		}
		if cfg.retentionVacuum > 0 && time.Since(vacuumed) >= cfg.retentionVacuum {
			vacuumed = time.Now()
			if _, err := b.admin.Exec(ctx, "VACUUM "+tables.Claims+", "+tables.Groups); err != nil {
				return fmt.Errorf("vacuum: %w", err)
			}
		}
		var msgs, claims, parts int64
		if err := b.admin.QueryRow(ctx, `SELECT `+totalSizeSQL(1)+`, `+totalSizeSQL(2)+`,
			(SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1))`,
			tables.Messages, tables.Claims).Scan(&msgs, &claims, &parts); err != nil {
			return fmt.Errorf("read the sizes: %w", err)
		}
		peakMsgs, peakClaims, lastMsgs, lastClaims = max(peakMsgs, msgs), max(peakClaims, claims), msgs, claims
		fmt.Printf("%5.0f %10d %10d %8d | %8.1f MiB %10d | %8.2f MiB\n", time.Since(start).Seconds(), published, h, published-h,
			mib(uint64(msgs)), parts, mib(uint64(claims)))
		if settled(published, h) {
			break
		}
	}
	n := p.published.Load()
	payload := float64(n) * float64(cfg.payloadSize)
	if c.onSQLite() {
		fmt.Printf("\n- %d messages (%.1f MiB of payload) through in %s; database file and WAL at most %.1f MiB, %.1f MiB at the end; pages in use at most %.1f MiB, %.1f MiB at the end; messages table at most %d rows\n\n",
			n, payload/(1<<20), doneAt.Sub(start).Round(time.Second), mib(uint64(peakMsgs)), mib(uint64(lastMsgs)),
			mib(uint64(peakClaims)), mib(uint64(lastClaims)), peakRows)
		return nil
	}
	if c.onMySQL() {
		fmt.Printf("\n- %d messages (%.1f MiB of payload) through in %s; messages table's file at most %.1f MiB, %.1f MiB at the end; claims table's file at most %.2f MiB, %.2f MiB at the end; messages table at most %d rows, %d at the end\n\n",
			n, payload/(1<<20), doneAt.Sub(start).Round(time.Second), mib(uint64(peakMsgs)), mib(uint64(lastMsgs)),
			mib(uint64(peakClaims)), mib(uint64(lastClaims)), peakRows, lastRows)
		return nil
	}
	fmt.Printf("\n- %d messages (%.1f MiB of payload) through in %s; messages table at most %.1f MiB, %.1f MiB at the end; claims table at most %.2f MiB, %.2f MiB at the end\n\n",
		n, payload/(1<<20), doneAt.Sub(start).Round(time.Second), mib(uint64(peakMsgs)), mib(uint64(lastMsgs)),
		mib(uint64(peakClaims)), mib(uint64(lastClaims)))
	return nil
}

// sqliteSizes are the sizes scenario 12 prints on SQLite.
type sqliteSizes struct {
	file, wal, inUse, rows int64
}

func (e *env) sqliteSizes(ctx context.Context, topic string) (sqliteSizes, error) {
	var st sqliteSizes
	if fi, err := os.Stat(e.file); err == nil {
		st.file = fi.Size()
	}
	if fi, err := os.Stat(e.file + "-wal"); err == nil {
		st.wal = fi.Size()
	}
	var pages, free, size int64
	if err := dbx.QueryRow(ctx, e.db, `SELECT (SELECT page_count FROM pragma_page_count()), (SELECT freelist_count FROM pragma_freelist_count()), (SELECT page_size FROM pragma_page_size())`, nil, &pages, &free, &size); err != nil {
		return st, err
	}
	st.inUse = (pages - free) * size
	if err := dbx.QueryRow(ctx, e.db, `SELECT count(*) FROM `+e.tables(topic).Messages, nil, &st.rows); err != nil {
		return st, err
	}
	return st, nil
}

// mysqlFiles reads the sizes of InnoDB tables' files. information_schema.TABLES's sizes of an
// InnoDB table are estimates, refreshed only when InnoDB recomputes the table's statistics;
// with innodb_file_per_table, each table is a file of its own, <datadir>/<database>/<table>.ibd,
// whose size is the table's. It is read from the server's list of its tablespaces
// (INNODB_SYS_TABLESPACES on MariaDB and MySQL 5.7, INNODB_TABLESPACES on MySQL 8), whose
// FILE_SIZE is the file's, or, on a server whose list lacks that column, from the file
// itself: the bench must then run on the server's machine.
type mysqlFiles struct {
	db     *sql.DB
	names  []string // the tablespaces' names, database/table as in the files' names
	paths  []string // the files
	query  string   // reads the tablespaces' FILE_SIZE by NAME; "" to stat the files
	source string   // where the sizes come from, for the heading
}

// openMySQLFiles finds the files of tables, in db's database, and checks that each is there.
func openMySQLFiles(ctx context.Context, db *sql.DB, tables ...string) (*mysqlFiles, error) {
	var datadir, perTable, database string
	var lower int
	if err := db.QueryRowContext(ctx, "SELECT @@datadir, @@innodb_file_per_table, @@lower_case_table_names, coalesce(DATABASE(), '')").
		Scan(&datadir, &perTable, &lower, &database); err != nil {
		return nil, fmt.Errorf("read the server's datadir: %w", err)
	}
	if perTable != "1" && !strings.EqualFold(perTable, "ON") {
		return nil, fmt.Errorf("%w: innodb_file_per_table is OFF: the tables are in the system tablespace, whose file says nothing of their sizes", errNA)
	}
	if database == "" {
		return nil, errors.New("-mysql-dsn names no database")
	}
	dir, err := mysqlFileName(database, lower)
	if err != nil {
		return nil, err
	}
	f := &mysqlFiles{db: db}
	for _, t := range tables {
		file, err := mysqlFileName(t, lower)
		if err != nil {
			return nil, err
		}
		f.names = append(f.names, dir+"/"+file)
		f.paths = append(f.paths, filepath.Join(datadir, dir, file+".ibd"))
	}
	var view string
	err = db.QueryRowContext(ctx, "SELECT TABLE_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = 'information_schema'\n"+
		"\tAND TABLE_NAME IN ('INNODB_TABLESPACES', 'INNODB_SYS_TABLESPACES') AND COLUMN_NAME = 'FILE_SIZE' LIMIT 1").Scan(&view)
	switch {
	case err == nil:
		f.query = fmt.Sprintf("SELECT NAME, FILE_SIZE FROM information_schema.%s WHERE NAME IN (?%s)", view, strings.Repeat(", ?", len(tables)-1))
		f.source = "their sizes as FILE_SIZE of information_schema." + view + " says"
	case errors.Is(err, sql.ErrNoRows):
		f.source = "their sizes read from the files on this machine (the server's information_schema has no FILE_SIZE of its tablespaces)"
	default:
		return nil, fmt.Errorf("look for the tablespaces' FILE_SIZE in information_schema: %w", err)
	}
	if _, err := f.sizes(ctx); err != nil {
		return nil, err
	}
	return f, nil
}

// sizes are the files' sizes, in the order of the tables.
func (f *mysqlFiles) sizes(ctx context.Context) ([]int64, error) {
	out := make([]int64, len(f.names))
	if f.query == "" {
		for i, p := range f.paths {
			fi, err := os.Stat(p)
			if err != nil {
				return nil, fmt.Errorf("the table's file (the bench reads it on this machine, the server's): %w", err)
			}
			out[i] = fi.Size()
		}
		return out, nil
	}
	args := make([]any, len(f.names))
	for i, n := range f.names {
		args[i] = n
	}
	rows, err := f.db.QueryContext(ctx, f.query, args...)
	if err != nil {
		return nil, fmt.Errorf("read the tablespaces' FILE_SIZE: %w", err)
	}
	defer rows.Close()
	found := map[string]int64{}
	for rows.Next() {
		var name string
		var size int64
		if err := rows.Scan(&name, &size); err != nil {
			return nil, fmt.Errorf("read the tablespaces' FILE_SIZE: %w", err)
		}
		found[name] = size
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the tablespaces' FILE_SIZE: %w", err)
	}
	for i, n := range f.names {
		size, ok := found[n]
		if !ok {
			return nil, fmt.Errorf("no tablespace %s (the file %s): the table has no file of its own", n, f.paths[i])
		}
		out[i] = size
	}
	return out, nil
}

// mysqlFileName is name as MySQL spells it in a file's name (and in its tablespaces' names):
// ASCII letters, digits and _ stand for themselves, any other character is @ and its code
// point in four hex digits ("-" is @002d, "#" @0023). Letters beyond ASCII have codes of
// their own, which are not worked out here: the library's names and the bench's database are
// ASCII. With lower_case_table_names set (1 or 2), InnoDB's names are in lower case.
func mysqlFileName(name string, lowerCaseTableNames int) (string, error) {
	if lowerCaseTableNames != 0 {
		name = strings.ToLower(name)
	}
	var b strings.Builder
	for _, r := range name {
		switch {
		case r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_':
			b.WriteRune(r)
		case r < 0x80:
			fmt.Fprintf(&b, "@%04x", r)
		default:
			return "", fmt.Errorf("the file name of %q: MySQL's spelling of characters beyond ASCII is not worked out here", name)
		}
	}
	return b.String(), nil
}
