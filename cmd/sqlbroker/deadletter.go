package main

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	_ "modernc.org/sqlite" // the SQLite driver behind sqlite: URLs

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// dlFlags are the flags of dead-letter list, dead-letter redrive and peek.
type dlFlags struct {
	offset, limit, batch int
	n, width             int
	to                   string
	dryRun               bool
}

func (f *dlFlags) register(cmd string, fs *flag.FlagSet) {
	switch cmd {
	case "dead-letter list":
		fs.IntVar(&f.offset, "offset", 0, "the first offset to list")
		fs.IntVar(&f.n, "n", sqlbroker.DefaultListLimit, "messages to list")
	case "peek":
		fs.IntVar(&f.offset, "offset", 0, "the first offset to show")
		fs.IntVar(&f.n, "n", 10, "messages to show")
		fs.IntVar(&f.width, "width", 60, "characters of payload shown (text), or twice the bytes shown in hex (binary)")
	case "dead-letter redrive":
		fs.StringVar(&f.to, "to", "", "the topic every message goes to (default: the topic each came from)")
		fs.IntVar(&f.limit, "limit", 0, "messages to move at most (default: all)")
		fs.IntVar(&f.batch, "batch", sqlbroker.DefaultRedriveBatch, "messages moved per transaction")
		fs.BoolVar(&f.dryRun, "dry-run", false, "say what would move, move nothing")
	}
}

// run runs one of the commands on topic.
func (f *dlFlags) run(ctx context.Context, cmd string, admin *sqlbroker.Admin, topic string, out output, stderr io.Writer, rawURL string) int {
	if f.n < 0 || f.limit < 0 || f.offset < 0 || f.width < 0 {
		fmt.Fprintf(stderr, "sqlbroker %s: -offset, -n, -limit and -width must not be negative\n", cmd)
		return 2
	}
	switch cmd {
	case "dead-letter list":
		list, err := admin.DeadLetters(ctx, topic, sqlbroker.ListOptions{Offset: int64(f.offset), Limit: max(f.n, 1)})
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		if out.json {
			return out.encode(list, stderr, rawURL)
		}
		fmt.Fprintf(out.w, "topic %q: %d dead letters", topic, list.Total)
		if len(list.Letters) < int(list.Total) {
			fmt.Fprintf(out.w, " (%d listed from offset %d: see -offset, -n)", len(list.Letters), f.offset)
		}
		fmt.Fprintln(out.w)
		if len(list.Letters) == 0 {
			return 0
		}
		tw := out.table("OFFSET", "UUID", "MOVED AT", "FROM TOPIC", "GROUP", "ATTEMPTS", "REDRIVES", "LAST ERROR")
		for _, d := range list.Letters {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", d.Offset, d.UUID, d.PublishedAt.Format("2006-01-02 15:04:05"),
				orDash(d.OriginalTopic), orDash(d.Group), orDash(num(d.Attempts)), d.Redrives, orDash(preview([]byte(d.LastError), 40)))
		}
		return out.flush(tw, stderr, rawURL)
	case "peek":
		msgs, err := admin.Peek(ctx, topic, sqlbroker.ListOptions{Offset: int64(f.offset), Limit: max(f.n, 1)})
		if err != nil {
			return fail(stderr, rawURL, err)
		}
		if out.json {
			type peeked struct {
				sqlbroker.StoredMessage
				PayloadText *string `json:"payload_text,omitempty"`
			}
			rows := make([]peeked, 0, len(msgs))
			for _, m := range msgs {
				p := peeked{StoredMessage: m}
				if isText(m.Payload) {
					s := string(m.Payload)
					p.PayloadText = &s
				}
				rows = append(rows, p)
			}
			return out.encode(rows, stderr, rawURL)
		}
		if len(msgs) == 0 {
			fmt.Fprintf(out.w, "topic %q: no message at offset %d or after\n", topic, f.offset)
			return 0
		}
		for i, m := range msgs {
			if i > 0 {
				fmt.Fprintln(out.w)
			}
			fmt.Fprintf(out.w, "offset %d  uuid %s  published %s  %d bytes\n", m.Offset, m.UUID, m.PublishedAt.Format("2006-01-02 15:04:05.000Z07:00"), len(m.Payload))
			if !m.DeliverAt.IsZero() {
				fmt.Fprintf(out.w, "  deliver at %s\n", m.DeliverAt.Format("2006-01-02 15:04:05.000Z07:00"))
			}
			keys := make([]string, 0, len(m.Metadata))
			for k := range m.Metadata {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(out.w, "  %s: %s\n", k, preview([]byte(m.Metadata[k]), f.width))
			}
			fmt.Fprintf(out.w, "  payload: %s\n", preview(m.Payload, f.width))
		}
		return 0
	case "dead-letter redrive":
		res, err := admin.Redrive(ctx, topic, sqlbroker.RedriveOptions{To: f.to, Limit: f.limit, BatchSize: f.batch, DryRun: f.dryRun})
		if err != nil {
			if res.Moved > 0 {
				fmt.Fprintf(stderr, "sqlbroker dead-letter redrive: %d messages were moved before the error; run it again to move the rest\n", res.Moved)
			}
			return fail(stderr, rawURL, err)
		}
		if out.json {
			return out.encode(res, stderr, rawURL)
		}
		verb := "moved"
		if res.DryRun {
			verb = "would move (dry run)"
		}
		fmt.Fprintf(out.w, "topic %q: %s %d messages", topic, verb, res.Moved)
		if res.Skipped > 0 {
			fmt.Fprintf(out.w, "; %d left in place (no topic of origin known: give -to)", res.Skipped)
		}
		fmt.Fprintln(out.w)
		if len(res.Topics) > 0 {
			tw := out.table("TO TOPIC", "MESSAGES")
			keys := make([]string, 0, len(res.Topics))
			for k := range res.Topics {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(tw, "%s\t%d\n", k, res.Topics[k])
			}
			return out.flush(tw, stderr, rawURL)
		}
	}
	return 0
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func num(n int64) string {
	if n == 0 {
		return ""
	}
	return strconv.FormatInt(n, 10)
}

// isText reports whether b is UTF-8 text of printable characters (and tabs and newlines).
func isText(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if !unicode.IsPrint(r) && r != '\n' && r != '\t' && r != '\r' {
			return false
		}
	}
	return true
}

// preview shows b in at most about width characters: text quoted, binary as hex.
func preview(b []byte, width int) string {
	width = max(width, 8)
	if isText(b) {
		s := string(b)
		if utf8.RuneCountInString(s) > width {
			s = string([]rune(s)[:width])
			return strconv.Quote(s) + "…"
		}
		if strings.ContainsAny(s, "\n\t\r\"") || strings.TrimSpace(s) != s {
			return strconv.Quote(s)
		}
		return s
	}
	n := min(len(b), width/2)
	s := "hex:" + hex.EncodeToString(b[:n])
	if n < len(b) {
		s += "…"
	}
	return s
}

// openSQLite opens the SQLite database of a sqlite: URL (rest follows "sqlite:") as Open
// does, except that the file must exist (mode=rw) unless the URL says otherwise: a command
// given a mistyped path must not create an empty database.
func openSQLite(ctx context.Context, rest string) (sqlbroker.DB, func(), error) {
	path, query, _ := strings.Cut(rest, "?")
	if path == "" || strings.HasPrefix(path, "//") || path == ":memory:" {
		return sqlbroker.DB{}, nil, errors.New("sqlite: URL names no file: want sqlite:path/to/file.db or sqlite:/absolute/path.db")
	}
	params, err := url.ParseQuery(query)
	if err != nil {
		return sqlbroker.DB{}, nil, fmt.Errorf("sqlite:%s: malformed parameters after '?': %w", rest, err)
	}
	if params.Get("mode") == "" {
		params.Set("mode", "rw")
	}
	params.Add("_pragma", "busy_timeout(5000)")
	db, err := sql.Open("sqlite", "file:"+path+"?"+params.Encode())
	if err != nil {
		return sqlbroker.DB{}, nil, fmt.Errorf("opening sqlite:%s: %w", path, err)
	}
	db.SetMaxOpenConns(2)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		if _, serr := os.Stat(path); errors.Is(serr, fs.ErrNotExist) && params.Get("mode") == "rw" {
			return sqlbroker.DB{}, nil, fmt.Errorf("opening sqlite:%s: no such file (the command opens an existing database; add ?mode=rwc to create one)", path)
		}
		return sqlbroker.DB{}, nil, fmt.Errorf("opening sqlite:%s: %w", path, err)
	}
	return sqlbroker.SQLite(db), func() { _ = db.Close() }, nil
}
