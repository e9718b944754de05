package ident

import (
	"strings"
	"testing"
)

// FuzzValidateName checks that whatever ValidateName accepts is safe to quote and never
// produces an identifier PostgreSQL would truncate.
func FuzzValidateName(f *testing.F) {
	for _, s := range []string{"orders", "", "a b", `x"; DROP TABLE t; --`, "ü", strings.Repeat("z", 300), "a/b:c.d-e_f", "$", "a$sqlbroker$b", "$1", "$$"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		if err := ValidateName("topic", name); err != nil {
			return
		}
		if strings.ContainsAny(name, "\"'; \x00\\") {
			t.Fatalf("accepted %q", name)
		}
		for _, suffix := range []string{"_messages", "_groups", "_claims"} {
			tn := TableName("sqlbroker_", name, suffix)
			if len(tn) > MaxIdentifierLength {
				t.Fatalf("table name %q is %d bytes", tn, len(tn))
			}
			if q := Quote(tn); strings.Count(q, `"`) != 2 {
				t.Fatalf("quoted %q", q)
			}
		}
	})
}
