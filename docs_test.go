package sqlbroker_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocs_snippetsCompile builds every ```go block of README.md and docs/*.md, so that a
// reader who copies one gets code that compiles.
//
// The convention:
//   - A block whose first line of code is "package ..." is a whole file, built as it is.
//   - Any other block is a fragment: its import lines (at its start) are the file's imports,
//     and the rest is the body of a function that returns an error and has these in scope,
//     as a program around the fragment would: ctx (context.Context), logger
//     (watermill.LoggerAdapter), pool (*pgxpool.Pool), sqlDB (*sql.DB), db (sqlbroker.DB),
//     router (*message.Router), msg (*message.Message), keys (*sqlbroker.KeyRepository),
//     sub1, sub2 (*sqlbroker.Subscriber), and the handlers charge(ctx, payload) error and
//     export (a message.NoPublishHandlerFunc). The packages context, database/sql, errors,
//     os, time, watermill, message, middleware, cqrs, pgx, pgxpool, the Prometheus client
//     and sqlbroker are imported; watermill-sql's package is imported as wsql when a block
//     names it. A fragment may declare any of these names again.
//   - A block preceded by the line "<!-- docs-test: skip -->" is not built (say why beside it).
//
// The blocks are built in the tests/migrate module, which also requires watermill-sql (for
// the "before" side of docs/migrating.md). An error names the Markdown file and line.
func TestDocs_snippetsCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the snippets with the go command")
	}
	files, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append([]string{"README.md"}, files...)
	var blocks []docBlock
	for _, f := range files {
		bs, err := goBlocks(f)
		if err != nil {
			t.Fatal(err)
		}
		blocks = append(blocks, bs...)
	}
	if len(blocks) == 0 {
		t.Fatal("no go blocks found")
	}
	dir, err := os.MkdirTemp("tests/migrate", "_docsnippets")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	args := []string{"build"}
	for i, b := range blocks {
		args = append(args, "./"+filepath.Join(filepath.Base(dir), fmt.Sprintf("b%d", i)))
		pkgDir := filepath.Join(dir, fmt.Sprintf("b%d", i))
		if err := os.Mkdir(pkgDir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pkgDir, "snippet.go"), []byte(b.source(i)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Named one by one: a pattern with ... skips a directory whose name starts with _.
	cmd := exec.Command("go", args...)
	cmd.Dir = "tests/migrate"
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	// "# <module>/_docsnippetsN/b3" heads the errors of block 3.
	failed := regexp.MustCompile(`(?m)^# \S+/b(\d+)$`).FindAllStringSubmatch(string(out), -1)
	for _, m := range failed {
		var i int
		fmt.Sscan(m[1], &i)
		t.Errorf("the go block at %s:%d does not compile", blocks[i].file, blocks[i].line)
	}
	t.Fatalf("go build of the docs' snippets: %v\n%s", err, out)
}

// docBlock is one ```go block: its file, the line of its first line of code, its code.
type docBlock struct {
	file string
	line int
	code []string
}

func goBlocks(file string) ([]docBlock, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []docBlock
	var cur *docBlock
	skip := false
	prev := ""
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		n++
		line := sc.Text()
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			skip = strings.TrimSpace(prev) == "<!-- docs-test: skip -->"
			cur = &docBlock{file: file, line: n + 1}
		case cur != nil && strings.TrimSpace(line) == "```":
			if !skip {
				out = append(out, *cur)
			}
			cur = nil
		case cur != nil:
			cur.code = append(cur.code, line)
		}
		prev = line
	}
	return out, sc.Err()
}

var defaultImports = []struct{ name, path, use string }{
	{"context", "context", "context.Background"},
	{"sql", "database/sql", "sql.Open"},
	{"errors", "errors", "errors.New"},
	{"os", "os", "os.Getenv"},
	{"time", "time", "time.Second"},
	{"watermill", "github.com/ThreeDotsLabs/watermill", "watermill.NewUUID"},
	{"message", "github.com/ThreeDotsLabs/watermill/message", "message.NewMessage"},
	{"middleware", "github.com/ThreeDotsLabs/watermill/message/router/middleware", "middleware.Retry{}"},
	{"cqrs", "github.com/ThreeDotsLabs/watermill/components/cqrs", "cqrs.CommandBusConfig{}"},
	{"pgx", "github.com/jackc/pgx/v5", "pgx.ErrNoRows"},
	{"pgxpool", "github.com/jackc/pgx/v5/pgxpool", "pgxpool.New"},
	{"prometheus", "github.com/prometheus/client_golang/prometheus", "prometheus.MustRegister"},
	{"sqlbroker", "github.com/sqlbroker/watermill-sqlbroker", "sqlbroker.Pgx"},
}

var importLine = regexp.MustCompile(`^import\s+(\w+\s+|_\s+)?"([^"]+)"`)

func (b docBlock) source(i int) string {
	for _, l := range b.code {
		if strings.TrimSpace(l) == "" || strings.HasPrefix(strings.TrimSpace(l), "//") {
			continue
		}
		if strings.HasPrefix(l, "package ") {
			return fmt.Sprintf("//line %s:%d\n%s\n", b.file, b.line, strings.Join(b.code, "\n"))
		}
		break
	}
	// A fragment: leading import lines, then the body.
	own := map[string]string{} // path -> the line
	body := 0
	for body < len(b.code) {
		l := strings.TrimSpace(b.code[body])
		if m := importLine.FindStringSubmatch(l); m != nil {
			own[m[2]] = l
		} else if l != "" {
			break
		}
		body++
	}
	var s strings.Builder
	fmt.Fprintf(&s, "package b%d\n\nimport (\n", i)
	var uses []string
	for _, imp := range defaultImports {
		if _, ok := own[imp.path]; ok {
			continue
		}
		fmt.Fprintf(&s, "\t%s %q\n", imp.name, imp.path)
		uses = append(uses, imp.use)
	}
	code := strings.Join(b.code[body:], "\n")
	if strings.Contains(code, "wsql.") {
		s.WriteString("\twsql \"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql\"\n")
	}
	for _, l := range own {
		s.WriteString("\t" + strings.TrimPrefix(l, "import ") + "\n")
	}
	s.WriteString(")\n\n")
	for _, u := range uses {
		fmt.Fprintf(&s, "var _ = %s\n", u)
	}
	s.WriteString(`
func charge(ctx context.Context, payload []byte) error { return nil }

var export message.NoPublishHandlerFunc

func snippet(ctx context.Context, logger watermill.LoggerAdapter, pool *pgxpool.Pool, sqlDB *sql.DB,
	db sqlbroker.DB, router *message.Router, msg *message.Message, keys *sqlbroker.KeyRepository,
	sub1, sub2 *sqlbroker.Subscriber) error {
	{
`)
	fmt.Fprintf(&s, "//line %s:%d\n%s\n", b.file, b.line+body, code)
	s.WriteString("\t}\n\treturn nil\n}\n")
	return s.String()
}
