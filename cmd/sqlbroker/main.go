// Command sqlbroker inspects and manages the topics and consumer groups of watermill-sqlbroker
// in a PostgreSQL or SQLite database.
//
//	sqlbroker inspect [-topic T]... [-claims N] [-json]
//	sqlbroker schema TOPIC
//	sqlbroker retention -older-than D [-dedup-table T] [TOPIC...]
//	sqlbroker group reset TOPIC GROUP (-offset N | -time T)
//	sqlbroker group delete TOPIC GROUP
//	sqlbroker peek TOPIC [-offset N] [-n N] [-width W]
//	sqlbroker dead-letter list DEADTOPIC [-offset N] [-n N]
//	sqlbroker dead-letter redrive DEADTOPIC [-to TOPIC] [-limit N] [-batch N] [-dry-run]
//	sqlbroker migrate-watermill-sql TOPIC -group G [-batch N] [-dry-run]
//
// Every command takes -url (or reads SQLBROKER_URL, then DATABASE_URL), -schema and -prefix
// (the Schema and TablePrefix of the publishers and subscribers), -timeout and -json. The
// URL's scheme picks the driver: postgres:// (pgx), libpq+postgres:// (lib/pq) or sqlite:
// (a file that must exist, unless the URL sets mode=rwc); a key=value connection string is
// read by pgx. Every command but migrate-watermill-sql runs on SQLite; there inspect shows
// the held-back messages and the xmin horizon as not applicable, and schema prints SQLite's
// DDL. Errors and output never show its password.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq"

	_ "github.com/go-sql-driver/mysql" // the MySQL driver behind mysql:// URLs
	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

const usage = `usage:
  sqlbroker inspect [-topic T]... [-claims N]        topics, groups, lag, claims, the xmin horizon
  sqlbroker schema TOPIC                             the DDL of TOPIC's tables, for migrations
                                                     (SQLite's when -url is a sqlite: URL)
  sqlbroker retention -older-than D [-dedup-table T] [TOPIC...]
                                                     one retention pass over the settled messages
                                                     older than D (-older-than 0: every settled
                                                     one), of every topic by default, and expired
                                                     keys of a deduplication table
  sqlbroker group reset TOPIC GROUP (-offset N | -time T)
                                                     the group receives again from that message
  sqlbroker group delete TOPIC GROUP                 delete a group, so it stops holding retention
  sqlbroker peek TOPIC [-offset N] [-n N] [-width W] messages as stored: metadata, payload preview
  sqlbroker dead-letter list DEADTOPIC [-offset N] [-n N]
                                                     the messages of a dead-letter topic: where
                                                     from, which group, attempts, last error
  sqlbroker dead-letter redrive DEADTOPIC [-to TOPIC] [-limit N] [-batch N] [-dry-run]
                                                     move them back to the topic each came from
                                                     (or -to), one transaction per batch
  sqlbroker migrate-watermill-sql TOPIC -group G [-batch N] [-dry-run]
                                                     copy what watermill-sql's group G has not
                                                     consumed of TOPIC (table watermill_TOPIC)
                                                     into TOPIC, in order; PostgreSQL only; a
                                                     run again resumes (raise -timeout for a
                                                     large backlog)

common flags (after the command):
  -url URL       database URL (default: $SQLBROKER_URL, then $DATABASE_URL):
                 postgres://, libpq+postgres:// or sqlite:path/to/file.db
                 (every command runs on SQLite but migrate-watermill-sql)
  -schema S      PostgreSQL schema of the tables (default: the search_path)
  -prefix P      table prefix (default: sqlbroker_)
  -timeout D     bound of the whole command (default: 30s)
  -json          JSON output, for scripts
`

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

// common are the flags every command takes.
type common struct {
	url, schema, prefix string
	timeout             time.Duration
	json                bool
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.url, "url", "", "database URL (default: $SQLBROKER_URL, then $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", "", "PostgreSQL schema of the tables")
	fs.StringVar(&c.prefix, "prefix", "", "table prefix (default: sqlbroker_)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "bound of the whole command")
	fs.BoolVar(&c.json, "json", false, "JSON output")
}

// isHelp reports whether arg asks for the usage.
func isHelp(arg string) bool {
	switch arg {
	case "-h", "-help", "--help", "help":
		return true
	}
	return false
}

// run is the command; it returns the exit code: 0, 1 for a failure, 2 for a usage error.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	if isHelp(args[0]) {
		// Asked for: the usage on stdout and success, as Go's flag package does for -h.
		fmt.Fprint(stdout, usage)
		return 0
	}
	cmd, args := args[0], args[1:]
	if cmd == "group" || cmd == "dead-letter" {
		if len(args) == 0 {
			fmt.Fprint(stderr, usage)
			return 2
		}
		if isHelp(args[0]) {
			fmt.Fprint(stdout, usage)
			return 0
		}
		cmd, args = cmd+" "+args[0], args[1:]
	}
	var c common
	fs := flag.NewFlagSet("sqlbroker "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {} // printed below: on stdout when asked for, on stderr after an error
	c.register(fs)
	var topics multi
	var claims int
	var olderThan time.Duration
	var offset int64 = -1
	var at string
	var dlf dlFlags
	var keyTable string
	var mig sqlbroker.MigrateOptions
	var migGroup string
	switch cmd {
	case "inspect":
		fs.Var(&topics, "topic", "topic to read (repeatable; default: every topic found)")
		fs.IntVar(&claims, "claims", 20, "claims to list per topic, with their lease deadline or lock holder (on PostgreSQL, reads pg_locks)")
	case "retention":
		fs.DurationVar(&olderThan, "older-than", 0, "delete only settled messages older than this")
		fs.StringVar(&keyTable, "dedup-table", "", "also delete the expired keys of this deduplication table (a KeyRepository's)")
	case "group reset":
		fs.Int64Var(&offset, "offset", -1, "the first offset the group receives again")
		fs.StringVar(&at, "time", "", "the first publication time (RFC 3339) the group receives again")
	case "dead-letter list", "dead-letter redrive", "peek":
		dlf.register(cmd, fs)
	case "migrate-watermill-sql":
		fs.StringVar(&migGroup, "group", "", "watermill-sql consumer group whose unconsumed messages are copied ('' is its default group)")
		fs.IntVar(&mig.BatchSize, "batch", sqlbroker.DefaultMigrateBatchSize, "messages per transaction")
		fs.BoolVar(&mig.DryRun, "dry-run", false, "count what would be copied, change nothing")
		fs.StringVar(&mig.SourceSchema, "source-schema", "", "PostgreSQL schema of watermill-sql's tables (default: the search_path)")
	case "schema", "group delete":
	default:
		fmt.Fprintf(stderr, "sqlbroker: unknown command %q\n%s", cmd, usage)
		return 2
	}
	if err := parse(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, usage)
			return 0
		}
		fmt.Fprint(stderr, usage)
		return 2
	}
	pos := fs.Args()
	want := map[string]int{"schema": 1, "group reset": 2, "group delete": 2, "dead-letter list": 1, "dead-letter redrive": 1, "peek": 1, "migrate-watermill-sql": 1}
	if n, ok := want[cmd]; ok && len(pos) != n {
		fmt.Fprintf(stderr, "sqlbroker %s: want %d arguments, got %d\n%s", cmd, n, len(pos), usage)
		return 2
	}
	if cmd == "inspect" && len(pos) > 0 {
		fmt.Fprintf(stderr, "sqlbroker inspect: unexpected argument %q (name topics with -topic)\n", pos[0])
		return 2
	}
	if cmd == "migrate-watermill-sql" && !flagSet(fs, "group") {
		fmt.Fprintf(stderr, "sqlbroker migrate-watermill-sql: give -group G, the watermill-sql consumer group whose unconsumed messages are copied (-group '' for its default group)\n")
		return 2
	}
	if cmd == "retention" && !flagSet(fs, "older-than") {
		// Without it, a pass would delete every settled message of every topic: say how old.
		fmt.Fprintf(stderr, "sqlbroker retention: give -older-than D (for example -older-than 168h): the pass deletes the settled messages older than D; -older-than 0 deletes every settled one\n")
		return 2
	}
	if cmd == "group reset" && (offset < 0) == (at == "") {
		fmt.Fprintf(stderr, "sqlbroker group reset: give exactly one of -offset N (N >= 0) or -time T\n")
		return 2
	}

	rawURL := c.url
	for _, env := range []string{"SQLBROKER_URL", "DATABASE_URL"} {
		if rawURL == "" {
			rawURL = getenv(env)
		}
	}
	if cmd == "schema" {
		// It connects to nothing: the URL, when there is one, only says which database.
		var ddl string
		var err error
		if strings.HasPrefix(rawURL, "sqlite:") {
			if c.schema != "" {
				fmt.Fprintf(stderr, "sqlbroker schema: -schema %q is PostgreSQL's: a SQLite database has no schemas\n", c.schema)
				return 2
			}
			ddl, err = sqlbroker.SQLiteSchemaSQL(pos[0], c.prefix)
		} else if strings.HasPrefix(rawURL, "mysql://") {
			if c.schema != "" {
				fmt.Fprintf(stderr, "sqlbroker schema: -schema %q is PostgreSQL's: the tables live in the URL's MySQL database\n", c.schema)
				return 2
			}
			ddl, err = sqlbroker.MySQLSchemaSQL(pos[0], c.prefix)
		} else {
			ddl, err = sqlbroker.SchemaSQL(pos[0], c.schema, c.prefix)
		}
		if err != nil {
			return fail(stderr, "", err)
		}
		fmt.Fprint(stdout, ddl)
		return 0
	}
	if rawURL == "" {
		fmt.Fprintln(stderr, "sqlbroker: no database: give -url, or set SQLBROKER_URL or DATABASE_URL")
		return 2
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	db, closeDB, err := open(ctx, rawURL)
	if err != nil {
		return fail(stderr, rawURL, err)
	}
	defer closeDB()
	admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{Schema: c.schema, TablePrefix: c.prefix})
	if err != nil {
		return fail(stderr, rawURL, err)
	}
	out := output{w: stdout, json: c.json}

	switch cmd {
	case "dead-letter list", "dead-letter redrive", "peek":
		return dlf.run(ctx, cmd, admin, pos[0], out, stderr, rawURL)
	case "inspect":
		opts := sqlbroker.InspectOptions{Claims: claims}
		if len(topics) > 0 {
			opts.Topics = topics
		}
		for _, topic := range topics {
			// A topic named on the command line must exist: a typo is an error, not a row.
			if _, err := admin.Peek(ctx, topic, sqlbroker.ListOptions{Limit: 1}); err != nil {
				var missing *sqlbroker.MissingTableError
				if errors.As(err, &missing) {
					fmt.Fprintf(stderr, "sqlbroker inspect: no such topic %q (no table %s; check -schema and -prefix)\n", topic, missing.Table)
					return 1
				}
				return fail(stderr, rawURL, err)
			}
		}
		ins, err := admin.Inspect(ctx, opts)
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		err = out.inspection(ins)
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		for _, t := range ins.Topics {
			if t.Error != "" {
				fmt.Fprintf(stderr, "sqlbroker: topic %q: %s\n", t.Topic, redact(t.Error, rawURL))
			}
		}
	case "retention":
		if len(pos) == 0 {
			var more bool
			if pos, more, err = admin.Topics(ctx); err != nil {
				return fail(stderr, rawURL, err)
			}
			if more {
				fmt.Fprintf(stderr, "sqlbroker retention: more topics than the %d listed; name them to prune the others\n", sqlbroker.DefaultAdminMaxTopics)
			}
		}
		type row struct {
			Topic   string `json:"topic"`
			Deleted int64  `json:"deleted"`
		}
		var rows []row
		for _, topic := range pos {
			n, err := admin.Prune(ctx, topic, olderThan)
			if err != nil {
				return fail(stderr, rawURL, err)
			}
			rows = append(rows, row{topic, n})
		}
		if keyTable != "" {
			repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Schema: c.schema, Table: keyTable, PruneInterval: -1})
			if err != nil {
				return fail(stderr, rawURL, err)
			}
			n, err := repo.Prune(ctx)
			_ = repo.Close()
			if err != nil {
				return fail(stderr, rawURL, err)
			}
			rows = append(rows, row{"(expired keys of " + keyTable + ")", n})
		}
		if out.json {
			return out.encode(rows, stderr, rawURL)
		}
		tw := out.table("TOPIC", "DELETED")
		for _, r := range rows {
			fmt.Fprintf(tw, "%s\t%d\n", r.Topic, r.Deleted)
		}
		return out.flush(tw, stderr, rawURL)
	case "group reset":
		var first int64
		if at != "" {
			t, perr := time.Parse(time.RFC3339Nano, at)
			if perr != nil {
				fmt.Fprintf(stderr, "sqlbroker group reset: -time %q is not an RFC 3339 time (2006-01-02T15:04:05Z07:00)\n", at)
				return 2
			}
			first, err = admin.ResetGroupToTime(ctx, pos[0], pos[1], t)
		} else {
			first, err = admin.ResetGroup(ctx, pos[0], pos[1], offset)
		}
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		if out.json {
			return out.encode(map[string]any{"topic": pos[0], "consumer_group": pos[1], "next_offset": first}, stderr, rawURL)
		}
		fmt.Fprintf(stdout, "topic %q, consumer group %q: the next message it receives is offset %d\n", pos[0], pos[1], first)
	case "migrate-watermill-sql":
		res, err := admin.MigrateWatermillSQL(ctx, pos[0], migGroup, mig)
		if out.json {
			if err != nil {
				return fail(stderr, rawURL, err)
			}
			return out.encode(res, stderr, rawURL)
		}
		verb := "copied"
		if mig.DryRun {
			verb = "would copy"
		}
		fmt.Fprintf(stdout, "topic %q, watermill-sql consumer group %q: %s %d messages (%d transactions)\n", pos[0], migGroup, verb, res.Migrated, res.Batches)
		if res.HeldBack > 0 {
			fmt.Fprintf(stdout, "%d more are held back by a transaction still running\n", res.HeldBack)
		}
		if err != nil {
			return fail(stderr, rawURL, err)
		}
	case "group delete":
		n, err := admin.DeleteGroup(ctx, pos[0], pos[1])
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		if out.json {
			return out.encode(map[string]any{"topic": pos[0], "consumer_group": pos[1], "claims_dropped": n}, stderr, rawURL)
		}
		fmt.Fprintf(stdout, "topic %q: consumer group %q deleted (%d claims dropped)\n", pos[0], pos[1], n)
	}
	return 0
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// parse parses flags wherever they stand among the positional arguments.
func parse(fs *flag.FlagSet, args []string) error {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	return fs.Parse(append([]string{"--"}, pos...))
}

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

func fail(stderr io.Writer, rawURL string, err error) int {
	fmt.Fprintf(stderr, "sqlbroker: %s\n", redact(strings.TrimPrefix(err.Error(), "sqlbroker: "), rawURL))
	return 1
}

// openMySQL opens the MySQL database of a mysql:// URL through a broker of two connections,
// and checks that it answers.
func openMySQL(ctx context.Context, rawURL string) (sqlbroker.DB, func(), error) {
	b, err := sqlbroker.Open(rawURL, sqlbroker.BrokerConfig{MaxConns: 2}, nil)
	if err != nil {
		return sqlbroker.DB{}, nil, err
	}
	if _, err := b.SQLDB().ExecContext(ctx, "DO 1"); err != nil {
		_ = b.Close()
		return sqlbroker.DB{}, nil, fmt.Errorf("connecting to %s: %w", redactURL(rawURL), err)
	}
	return b.DB(), func() { _ = b.Close() }, nil
}

// open connects to rawURL with the driver its scheme names, with at most two connections.
func open(ctx context.Context, rawURL string) (sqlbroker.DB, func(), error) {
	if rest, ok := strings.CutPrefix(rawURL, "sqlite:"); ok {
		return openSQLite(ctx, rest)
	}
	if scheme, _, ok := strings.Cut(rawURL, "://"); ok {
		switch scheme {
		case "postgres", "postgresql", "pgx+postgres", "pgx+postgresql", "libpq+postgres", "libpq+postgresql":
		case "mysql":
			return openMySQL(ctx, rawURL)
		default:
			return sqlbroker.DB{}, nil, fmt.Errorf("-url %s://...: unknown scheme: want postgres://, pgx+postgres://, libpq+postgres://, mysql:// or sqlite:path/to/file.db", scheme)
		}
	}
	if rest, ok := strings.CutPrefix(rawURL, "libpq+"); ok {
		db, err := sql.Open("postgres", rest)
		if err != nil {
			return sqlbroker.DB{}, nil, fmt.Errorf("connecting to %s: %w", redactURL(rawURL), err)
		}
		db.SetMaxOpenConns(2)
		if err := db.PingContext(ctx); err != nil {
			_ = db.Close()
			return sqlbroker.DB{}, nil, fmt.Errorf("connecting to %s: %w", redactURL(rawURL), err)
		}
		return sqlbroker.StdSQL(db), func() { _ = db.Close() }, nil
	}
	connURL := strings.TrimPrefix(rawURL, "pgx+")
	cfg, err := pgxpool.ParseConfig(connURL)
	if err != nil {
		return sqlbroker.DB{}, nil, fmt.Errorf("connecting to %s: %w", redactURL(rawURL), err)
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "sqlbroker"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
		if err != nil {
			pool.Close()
		}
	}
	if err != nil {
		return sqlbroker.DB{}, nil, fmt.Errorf("connecting to %s: %w", redactURL(rawURL), err)
	}
	return sqlbroker.Pgx(pool), pool.Close, nil
}

type output struct {
	w    io.Writer
	json bool
}

func (o output) table(headers ...string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(o.w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(headers, "\t"))
	return tw
}

func (o output) flush(tw *tabwriter.Writer, stderr io.Writer, rawURL string) int {
	if err := tw.Flush(); err != nil {
		return fail(stderr, rawURL, err)
	}
	return 0
}

func (o output) encode(v any, stderr io.Writer, rawURL string) int {
	enc := json.NewEncoder(o.w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fail(stderr, rawURL, err)
	}
	return 0
}

func (o output) inspection(ins sqlbroker.Inspection) error {
	if o.json {
		enc := json.NewEncoder(o.w)
		enc.SetIndent("", "  ")
		return enc.Encode(ins)
	}
	tw := o.table("TOPIC", "GROUP", "OFFSET", "LAG", "IN WORK", "WAITING", "DUE", "PARKED", "HELD BACK", "OLDEST UNSETTLED", "MOVED")
	for _, t := range ins.Topics {
		if t.Error != "" {
			fmt.Fprintf(tw, "%s\t(error: see below)\n", t.Topic)
			continue
		}
		if len(t.Groups) == 0 {
			fmt.Fprintf(tw, "%s\t(no group)\n", t.Topic)
		}
		for _, g := range t.Groups {
			lag := strconv.FormatInt(g.Lag, 10)
			if g.LagEstimated {
				lag = "~" + lag
			}
			heldBack := strconv.FormatInt(g.HeldBack, 10)
			if ins.Horizon.NotApplicable {
				heldBack = "n/a"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%d\t%d\t%d\t%s\t%s\t%s ago\n", t.Topic, g.Group, g.Offset, lag,
				g.InWork, g.Waiting, g.Due, g.Parked, heldBack, dur(g.OldestUnsettled), dur(g.SinceMoved))
		}
	}
	if ins.MoreTopics {
		fmt.Fprintf(tw, "(more topics: name them with -topic)\n")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var any bool
	for _, t := range ins.Topics {
		any = any || len(t.Claims) > 0
	}
	if any {
		fmt.Fprintln(o.w)
		tw = o.table("TOPIC", "GROUP", "OFFSET", "ATTEMPTS", "CLAIM")
		now := time.Now()
		for _, t := range ins.Topics {
			for _, c := range t.Claims {
				var what string
				switch {
				case c.Advisory && c.HolderPID != 0:
					what = fmt.Sprintf("advisory lock held by pid %d", c.HolderPID)
				case c.Advisory:
					what = "advisory, no lock held: its consumer is gone"
				case c.Parked:
					what = "parked behind an earlier message of its key"
				case c.Waiting && c.Deadline.After(now):
					what = "nacked, due again in " + dur(c.Deadline.Sub(now))
				case c.Waiting:
					what = "due again now"
				case c.Deadline.After(now):
					what = "leased until " + c.Deadline.UTC().Format("15:04:05.000") + " (in " + dur(c.Deadline.Sub(now)) + ")"
				default:
					what = "lease ran out " + dur(now.Sub(c.Deadline)) + " ago: due again"
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", t.Topic, c.Group, c.Offset, c.Attempts, what)
			}
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	fmt.Fprintln(o.w)
	h := ins.Horizon
	switch {
	case h.NotApplicable:
		_, err := fmt.Fprintln(o.w, "xmin horizon: not applicable (SQLite: offsets commit in order, no transaction holds a message back)")
		return err
	case h.Age == 0:
		_, err := fmt.Fprintln(o.w, "xmin horizon: no transaction holds a transaction id")
		return err
	case h.Prepared:
		_, err := fmt.Fprintf(o.w, "xmin horizon: prepared transaction %q (database %s), prepared %s ago\n", h.Application, h.Database, dur(h.Age))
		return err
	default:
		_, err := fmt.Fprintf(o.w, "xmin horizon: oldest transaction with an xid is pid %d (application %q, database %s, %s), open for %s\n",
			h.PID, h.Application, h.Database, h.State, dur(h.Age))
		return err
	}
}

func dur(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

// redactURL shows rawURL without its secrets: the userinfo password and the values of the
// password and sslpassword parameters, of a URL or of a key=value connection string.
func redactURL(rawURL string) string { return redact(rawURL, rawURL) }

// redact replaces in msg every secret rawURL carries, as written and decoded, wherever a
// driver echoed it.
func redact(msg, rawURL string) string {
	ss := secrets(rawURL)
	sort.Slice(ss, func(i, j int) bool { return len(ss[i]) > len(ss[j]) })
	for _, s := range ss {
		msg = strings.ReplaceAll(msg, s, "xxxxx")
	}
	return msg
}

// secrets lists the passwords in rawURL.
func secrets(rawURL string) []string {
	var out []string
	add := func(s string) {
		if s != "" && s != "xxxxx" {
			out = append(out, s)
			if dec, err := url.QueryUnescape(s); err == nil && dec != s {
				out = append(out, dec)
			}
			if dec, err := url.PathUnescape(s); err == nil && dec != s {
				out = append(out, dec)
			}
		}
	}
	if _, rest, ok := strings.Cut(rawURL, "://"); ok {
		// The userinfo ends at the last '@' (a password may hold '/', '?' or '#').
		if at := strings.LastIndexByte(rest, '@'); at >= 0 {
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
			}
		}
		if u, err := url.Parse(rawURL); err == nil {
			if pw, ok := u.User.Password(); ok {
				add(pw)
			}
			q := u.Query()
			for _, k := range []string{"password", "sslpassword"} {
				for _, v := range q[k] {
					add(v)
				}
			}
		}
	}
	// key=value pairs (a connection string, or parameters a URL parser did not read).
	for _, key := range []string{"password", "sslpassword"} {
		for off := 0; off < len(rawURL); {
			p := indexParam(rawURL[off:], key)
			if p < 0 {
				break
			}
			k := off + p + len(key)
			k += len(rawURL[k:]) - len(strings.TrimLeft(rawURL[k:], " "))
			k++ // '='
			k += len(rawURL[k:]) - len(strings.TrimLeft(rawURL[k:], " "))
			end := k
			if end < len(rawURL) && rawURL[end] == '\'' {
				end++
				for end < len(rawURL) && rawURL[end] != '\'' {
					if rawURL[end] == '\\' {
						end++
					}
					end++
				}
				end = min(end+1, len(rawURL))
				add(rawURL[k:end])
				add(strings.Trim(rawURL[k:end], "'"))
			} else {
				for end < len(rawURL) && rawURL[end] != ' ' && rawURL[end] != '&' {
					end++
				}
				add(rawURL[k:end])
			}
			off = end
		}
	}
	return out
}

// indexParam finds key followed by optional spaces and '=', at the start of s or after a
// separator (space, '?', '&').
func indexParam(s, key string) int {
	for off := 0; ; {
		p := strings.Index(s[off:], key)
		if p < 0 {
			return -1
		}
		p += off
		before := p == 0 || strings.ContainsRune(" ?&", rune(s[p-1]))
		rest := strings.TrimLeft(s[p+len(key):], " ")
		if before && strings.HasPrefix(rest, "=") {
			return p
		}
		off = p + len(key)
	}
}
