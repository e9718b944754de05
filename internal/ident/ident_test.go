package ident

import (
	"strings"
	"testing"
)

func TestValidateName_M6(t *testing.T) {
	good := []string{"a", "orders", "topic_5f1c-9a.v1", "events:OrderPlaced", "a/b", strings.Repeat("x", MaxNameLength),
		"$", "a$b", "price$usd", "$sqlbroker$", "x$1"}
	for _, n := range good {
		if err := ValidateName("topic", n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	bad := []string{"", " ", "a b", `x"; DROP TABLE t; --`, "ü", "a\x00b", "tab\t", strings.Repeat("x", MaxNameLength+1), "\xff",
		"a#b", "a'b", `a\b`, "a;b", "a%b", "a?b"}
	for _, n := range bad {
		err := ValidateName("topic", n)
		if err == nil {
			t.Errorf("ValidateName(%q) = nil, want an error", n)
			continue
		}
		if !strings.Contains(err.Error(), "topic") {
			t.Errorf("error %q does not name the field", err)
		}
	}
}

func TestTableName_M6(t *testing.T) {
	short := TableName("sqlbroker_", "orders", "_messages")
	if short != "sqlbroker_orders_messages" {
		t.Fatalf("got %q", short)
	}
	long1 := TableName("sqlbroker_", strings.Repeat("a", 200)+"1", "_messages")
	long2 := TableName("sqlbroker_", strings.Repeat("a", 200)+"2", "_messages")
	if len(long1) > MaxIdentifierLength || len(long2) > MaxIdentifierLength {
		t.Fatalf("too long: %d %d", len(long1), len(long2))
	}
	if long1 == long2 {
		t.Fatalf("two topics share the table %q", long1)
	}
	if !strings.HasSuffix(long1, "_messages") {
		t.Fatalf("suffix lost: %q", long1)
	}
}

func TestQuote(t *testing.T) {
	if got := Quote(`a"b`); got != `"a""b"` {
		t.Fatalf("got %s", got)
	}
	if got := Qualified("s", "t"); got != `"s"."t"` {
		t.Fatalf("got %s", got)
	}
}

// A short topic that spells out a long topic's shortened name must not share its tables.
func TestTableName_shortTopicCannotSpellALongOne(t *testing.T) {
	long := strings.Repeat("a", 100)
	name := TableName("sqlbroker_", long, "_messages")
	stem := strings.TrimSuffix(strings.TrimPrefix(name, "sqlbroker_"), "_messages")
	if err := ValidateName("topic", stem); err == nil && TableName("sqlbroker_", stem, "_messages") == name {
		t.Fatalf("topic %q shares the tables of a 100-byte topic: %q", stem, name)
	}
}
