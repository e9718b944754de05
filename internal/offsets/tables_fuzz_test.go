package offsets

import (
	"strings"
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// FuzzNewTables checks the identifiers built for every topic that validation accepts (M6):
// three distinct table names of at most 63 bytes, quoted (and schema-qualified) so that the
// SQL text holds each as exactly one identifier, and two distinct topics never share a table.
// On SQLite, which compares table names without regard to case, the names of two distinct
// topics never compare equal that way either, and an all-lower-case topic keeps the names it
// has on PostgreSQL (the names of files written before).
func FuzzNewTables(f *testing.F) {
	seeds := []struct{ topic, other, schema, prefix string }{
		{"orders", "orders2", "", "sqlbroker_"},
		{"a", "b", "app", "p_"},
		{strings.Repeat("a", 255), strings.Repeat("a", 254) + "b", "", "sqlbroker_"},
		{strings.Repeat("x", 40), strings.Repeat("x", 41), "s", strings.Repeat("q", 24)},
		{"events:Order/Placed.v1", "events:Order/Placed.v2", "", "sqlbroker_"},
		{`x"; DROP TABLE t; --`, "t", "", "sqlbroker_"},
		{"ü", "u", "", "sqlbroker_"},
		{"a$sqlbroker$b", "a$sqlbroker_$b", "", "sqlbroker_"},
		{"$sqlbroker_$$sqlbroker$", "$", "app", "sqlbroker_"},
		{"price$usd", "price.usd", "", "sqlbroker_"},
		{"Orders", "orders", "", "sqlbroker_"},
		{"ORDERS.dead-letter", "orders.dead-letter", "", "sqlbroker_"},
		{strings.Repeat("A", 255), strings.Repeat("a", 255), "", "sqlbroker_"},
		{"Orders#0123456789ab", "orders", "", "sqlbroker_"},
	}
	for _, s := range seeds {
		f.Add(s.topic, s.other, s.schema, s.prefix)
	}
	f.Fuzz(func(t *testing.T, topic, other, schema, prefix string) {
		if ident.ValidateName("topic", topic) != nil ||
			ident.ValidateIdentifier("Schema", schema, ident.MaxIdentifierLength, true) != nil ||
			ident.ValidateIdentifier("TablePrefix", prefix, 24, false) != nil {
			return
		}
		tb := NewTables(schema, prefix, topic)
		raw := []string{tb.MessagesName, tb.GroupsName, tb.ClaimsName}
		quoted := []string{tb.Messages, tb.Groups, tb.Claims}
		seen := map[string]bool{}
		for i, name := range raw {
			if name == "" || len(name) > ident.MaxIdentifierLength {
				t.Fatalf("topic %q: table name %q is %d bytes", topic, name, len(name))
			}
			if seen[name] {
				t.Fatalf("topic %q: two tables named %q", topic, name)
			}
			seen[name] = true
			if !strings.HasPrefix(name, prefix) {
				t.Fatalf("topic %q: table name %q lost the prefix %q", topic, name, prefix)
			}
			if strings.Contains(name, `"`) {
				t.Fatalf("topic %q: table name %q holds a quote", topic, name)
			}
			want := `"` + name + `"`
			if schema != "" {
				want = `"` + schema + `".` + want
			}
			if quoted[i] != want {
				t.Fatalf("topic %q: quoted %q, want %q", topic, quoted[i], want)
			}
		}
		// The dependent objects are named within the limit too.
		for _, s := range []string{"_m_seq", "_m_pkey", "_m_xid", "_g_seq", "_g_pkey", "_g_name", "_c_pkey", "_c_lease", "_c_park"} {
			if n := ident.TableName(prefix, topic, s); len(n) > ident.MaxIdentifierLength {
				t.Fatalf("topic %q: object name %q is %d bytes", topic, n, len(n))
			}
		}
		sql := tb.SchemaSQL()
		if strings.Count(sql, `"`)%2 != 0 {
			t.Fatalf("topic %q: unbalanced quotes in the schema SQL", topic)
		}
		// Each DO block's dollar quote ends where it should: its body runs from the tag to the
		// tag's next occurrence, and the first block's body holds the messages table's name
		// whole; every tag occurs an even number of times in the whole text.
		blocks := strings.Split(sql, "DO ")[1:]
		if len(blocks) == 0 {
			t.Fatalf("topic %q: no DO block in the schema SQL", topic)
		}
		for i, rest := range blocks {
			if !strings.HasPrefix(rest, "$") {
				continue // "DO " inside a name or a comment
			}
			tag := rest[:strings.Index(rest[1:], "$")+2]
			end := strings.Index(rest[len(tag):], tag)
			if end < 0 {
				t.Fatalf("topic %q: DO block %d has no closing tag %s", topic, i, tag)
			}
			if n := strings.Count(sql, tag); n%2 != 0 {
				t.Fatalf("topic %q: the dollar-quote tag %s occurs %d times", topic, tag, n)
			}
			if i == 0 && !strings.Contains(rest[len(tag):len(tag)+end], tb.Messages) {
				t.Fatalf("topic %q: the DO body does not hold %s whole", topic, tb.Messages)
			}
		}
		if lite := tb.OnSQLite().SchemaSQL(); strings.Count(lite, `"`)%2 != 0 {
			t.Fatalf("topic %q: unbalanced quotes in the SQLite schema SQL", topic)
		}
		lt := tb.OnSQLite()
		liteRaw := []string{lt.MessagesName, lt.GroupsName, lt.ClaimsName}
		liteQuoted := []string{lt.Messages, lt.Groups, lt.Claims}
		liteSeen := map[string]bool{}
		for i, name := range liteRaw {
			if name == "" || len(name) > ident.MaxIdentifierLength || !strings.HasPrefix(name, prefix) || strings.Contains(name, `"`) {
				t.Fatalf("topic %q: SQLite table name %q", topic, name)
			}
			if liteSeen[strings.ToLower(name)] {
				t.Fatalf("topic %q: two SQLite tables named %q without regard to case", topic, name)
			}
			liteSeen[strings.ToLower(name)] = true
			if strings.ToLower(topic) == topic && name != raw[i] {
				t.Fatalf("topic %q: SQLite table name %q, want the PostgreSQL name %q", topic, name, raw[i])
			}
			want := `"` + name + `"`
			if schema != "" {
				want = `"` + schema + `".` + want
			}
			if liteQuoted[i] != want {
				t.Fatalf("topic %q: SQLite quoted %q, want %q", topic, liteQuoted[i], want)
			}
		}
		if other != topic && ident.ValidateName("topic", other) == nil {
			ob := NewTables(schema, prefix, other)
			for _, a := range raw {
				for _, b := range []string{ob.MessagesName, ob.GroupsName, ob.ClaimsName} {
					if a == b {
						t.Fatalf("topics %q and %q share the table %q", topic, other, a)
					}
				}
			}
			ol := ob.OnSQLite()
			for _, a := range liteRaw {
				for _, b := range []string{ol.MessagesName, ol.GroupsName, ol.ClaimsName} {
					if strings.EqualFold(a, b) {
						t.Fatalf("topics %q and %q share the SQLite table %q (%q)", topic, other, a, b)
					}
				}
			}
		}
	})
}
