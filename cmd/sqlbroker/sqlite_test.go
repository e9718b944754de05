package main

import (
	"database/sql"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// twoStates builds testdb.State, on the same topic names, on PostgreSQL and on a new SQLite
// file, and returns the URLs of both, and when each build began.
func twoStates(t *testing.T) (topic, dead, pgURL, liteURL string, pgStart, liteStart time.Time) {
	t.Helper()
	topic, dead = testdb.Topic(t, ""), testdb.Topic(t, "")
	pgStart = time.Now()
	testdb.NewState(t, dbx.NewPgxPool(testdb.Pgx(t)), topic, dead)
	path := testdb.SQLitePath(t)
	db, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	defer db.Close()
	liteStart = time.Now()
	testdb.NewState(t, dbx.NewSQLitePool(db), topic, dead)
	return topic, dead, testdb.URL(), "sqlite:" + path, pgStart, liteStart
}

func inspectJSON(t *testing.T, url string, args ...string) sqlbroker.Inspection {
	t.Helper()
	code, out, stderr := sqlbrokerCmd(t, nil, append([]string{"inspect", "-json", "-url", url}, args...)...)
	require.Equal(t, 0, code, stderr)
	var ins sqlbroker.Inspection
	require.NoError(t, json.Unmarshal([]byte(out), &ins), out)
	return ins
}

// inspect on a SQLite file reports, for the same state, the figures it reports on
// PostgreSQL: positions, lag, claims in work, waiting and due, ages, and the claims listed;
// the held-back messages and the xmin horizon are marked not applicable there, not failed.
// dead-letter list reads the same dead letter on both.
func TestCommand_inspectSQLiteMatchesPostgres(t *testing.T) {
	t.Parallel()
	topic, dead, pgURL, liteURL, pgStart, liteStart := twoStates(t)

	pg := inspectJSON(t, pgURL, "-topic", topic, "-topic", dead, "-claims", "20")
	lite := inspectJSON(t, liteURL, "-topic", topic, "-topic", dead, "-claims", "20")
	require.Len(t, pg.Topics, 2)
	require.Len(t, lite.Topics, 2)
	assert.False(t, pg.Horizon.NotApplicable)
	assert.Equal(t, sqlbroker.Horizon{NotApplicable: true}, lite.Horizon)

	for i := range pg.Topics {
		p, l := pg.Topics[i], lite.Topics[i]
		assert.Empty(t, p.Error)
		assert.Empty(t, l.Error)
		assert.Equal(t, p.Topic, l.Topic)
		assert.Equal(t, p.Table, l.Table)
		require.Len(t, l.Groups, len(p.Groups), p.Topic)
		for j := range p.Groups {
			pg, lg := p.Groups[j], l.Groups[j]
			// The ages differ by when each state was built; each is the age of its own.
			assert.InDelta(t, time.Since(pgStart).Seconds(), pg.OldestUnsettled.Seconds(), 3, pg.Group)
			assert.InDelta(t, time.Since(liteStart).Seconds(), lg.OldestUnsettled.Seconds(), 3, lg.Group)
			assert.InDelta(t, time.Since(pgStart).Seconds(), pg.SinceMoved.Seconds(), 3, pg.Group)
			assert.InDelta(t, time.Since(liteStart).Seconds(), lg.SinceMoved.Seconds(), 3, lg.Group)
			assert.Positive(t, lg.OldestUnsettled)
			pg.OldestUnsettled, pg.SinceMoved, lg.OldestUnsettled, lg.SinceMoved = 0, 0, 0, 0
			assert.Equal(t, pg, lg)
		}
		require.Len(t, l.Claims, len(p.Claims), p.Topic)
		for j := range p.Claims {
			pc, lc := p.Claims[j], l.Claims[j]
			gap := liteStart.Sub(pgStart)
			assert.InDelta(t, pc.Deadline.Add(gap).UnixMilli(), lc.Deadline.UnixMilli(), 3000, "claim %d", pc.Offset)
			pc.Deadline, lc.Deadline = time.Time{}, time.Time{}
			assert.Equal(t, pc, lc)
		}
	}
	// The state itself, as the fixture says.
	groups := lite.Topics[0].Groups
	require.Len(t, groups, 2)
	assert.Equal(t, sqlbroker.GroupState{Group: "ahead", Offset: 8, Lag: 2, InWork: 3, Waiting: 1, Due: 2}, zeroAges(groups[0]))
	assert.Equal(t, sqlbroker.GroupState{Group: "behind", Offset: 0, Lag: 10}, zeroAges(groups[1]))
	assert.Len(t, lite.Topics[0].Claims, 6)
	assert.Empty(t, lite.Topics[1].Groups)

	// Every topic of the file, when none is named.
	all := inspectJSON(t, liteURL, "-claims", "0")
	var names []string
	for _, tp := range all.Topics {
		names = append(names, tp.Topic)
	}
	assert.ElementsMatch(t, []string{topic, dead}, names)

	// The table says which figures do not apply.
	code, out, stderr := sqlbrokerCmd(t, nil, "inspect", "-url", liteURL, "-topic", topic)
	require.Equal(t, 0, code, stderr)
	lines := strings.Split(out, "\n")
	assert.Equal(t, []string{topic, "ahead", "8", "2", "3", "1", "2", "0", "n/a"}, strings.Fields(lines[1])[:9])
	assert.Contains(t, out, "xmin horizon: not applicable")
	assert.Contains(t, out, "leased until")
	assert.Contains(t, out, "nacked, due again in")
	assert.Contains(t, out, "lease ran out")

	var lists [2]sqlbroker.DeadLetterList
	for i, url := range []string{pgURL, liteURL} {
		code, out, stderr := sqlbrokerCmd(t, nil, "dead-letter", "list", dead, "-json", "-url", url)
		require.Equal(t, 0, code, stderr)
		require.NoError(t, json.Unmarshal([]byte(out), &lists[i]))
	}
	require.Len(t, lists[1].Letters, 1)
	assert.Equal(t, lists[0].Total, lists[1].Total)
	p, l := lists[0].Letters[0], lists[1].Letters[0]
	assert.Equal(t, topic, l.OriginalTopic)
	assert.Equal(t, "ahead", l.Group)
	assert.Equal(t, []any{p.OriginalTopic, p.Group, p.Attempts, p.OriginalOffset, p.UUID}, []any{l.OriginalTopic, l.Group, l.Attempts, l.OriginalOffset, l.UUID})
}

func zeroAges(g sqlbroker.GroupState) sqlbroker.GroupState {
	g.OldestUnsettled, g.SinceMoved = 0, 0
	return g
}

// group reset, group delete and retention do on a SQLite file what they do on PostgreSQL to
// the same state, and say it in the same words.
func TestCommand_groupsAndRetentionOnSQLite(t *testing.T) {
	t.Parallel()
	topic, _, pgURL, liteURL, _, _ := twoStates(t)
	future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	steps := [][]string{
		{"group", "reset", topic, "ahead", "-offset", "2"},
		{"group", "reset", topic, "nobody", "-offset", "2"},
		{"retention", topic, "-older-than", "0"},
		{"group", "delete", topic, "behind"},
		{"retention", topic, "-older-than", "0"},
		{"group", "reset", topic, "ahead", "-time", future},
		{"group", "reset", topic, "ahead", "-time", "2000-01-01T00:00:00Z"},
		{"group", "delete", topic, "ahead", "-json"},
		{"inspect", "-topic", topic},
	}
	for _, step := range steps {
		var outs [2]string
		var codes [2]int
		for i, url := range []string{pgURL, liteURL} {
			var stderr string
			codes[i], outs[i], stderr = sqlbrokerCmd(t, nil, append(step, "-url", url)...)
			if codes[i] != 0 {
				outs[i] = stderr
			}
		}
		if step[0] == "inspect" {
			assert.Equal(t, 0, codes[1], outs[1])
			assert.Contains(t, outs[1], "(no group)")
			continue
		}
		assert.Equal(t, codes[0], codes[1], step)
		assert.Equal(t, outs[0], outs[1], step)
	}
}

// The same retention steps, checked against what they say: reset to offset 2, then retention
// deletes offset 1 once the group behind is gone; a reset past every message waits for the
// next one published.
func TestCommand_sqliteStepsSay(t *testing.T) {
	t.Parallel()
	topic, dead, _, liteURL, _, _ := twoStates(t)
	run := func(args ...string) string {
		t.Helper()
		code, out, stderr := sqlbrokerCmd(t, nil, append(args, "-url", liteURL)...)
		require.Equal(t, 0, code, stderr)
		return out
	}
	assert.Contains(t, run("group", "reset", topic, "ahead", "-offset", "2"), "offset 2")
	assert.Contains(t, run("retention", topic, "-older-than", "0", "-json"), `"deleted": 0`, "the behind group holds every message")
	assert.Contains(t, run("group", "delete", topic, "behind"), `consumer group "behind" deleted (0 claims dropped)`)
	out := run("retention", "-older-than", "0")
	assert.Contains(t, strings.Split(out, "\n"), topic+"  1", "every topic of the file; offset 1, which the ahead group passed:\n"+out)
	assert.Contains(t, strings.Split(out, "\n"), dead+"  0", out)
	assert.Contains(t, run("group", "reset", topic, "ahead", "-time", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)), "offset 11")
	ins := inspectJSON(t, liteURL, "-topic", topic)
	assert.Equal(t, int64(10), ins.Topics[0].Groups[0].Offset)
	assert.Equal(t, int64(0), ins.Topics[0].Groups[0].Lag)
}

// schema prints SQLite's DDL for a sqlite: URL, which creates tables the library then works
// on; PostgreSQL's otherwise.
func TestCommand_schemaForSQLite(t *testing.T) {
	t.Parallel()
	path := testdb.SQLitePath(t)
	code, out, stderr := sqlbrokerCmd(t, nil, "schema", "Orders", "-url", "sqlite:"+path)
	require.Equal(t, 0, code, stderr)
	want, err := sqlbroker.SQLiteSchemaSQL("Orders", "")
	require.NoError(t, err)
	assert.Equal(t, want, out)
	assert.NotContains(t, out, "IDENTITY")

	code, out, _ = sqlbrokerCmd(t, map[string]string{"SQLBROKER_URL": "sqlite:" + path}, "schema", "orders")
	require.Equal(t, 0, code)
	assert.Contains(t, out, "AUTOINCREMENT", "the URL of the environment says SQLite too")

	code, out, _ = sqlbrokerCmd(t, nil, "schema", "orders")
	require.Equal(t, 0, code)
	assert.Contains(t, out, "IDENTITY", "no URL: PostgreSQL")

	code, _, stderr = sqlbrokerCmd(t, nil, "schema", "orders", "-schema", "app", "-url", "sqlite:"+path)
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, "-schema")
}

// A URL of an unknown scheme is refused with the schemes the command takes, sqlite: among
// them, instead of being read as a key=value connection string.
func TestCommand_unknownSchemeNamesSQLite(t *testing.T) {
	t.Parallel()
	code, _, stderr := sqlbrokerCmd(t, nil, "inspect", "-url", "redis://u:hunter2@db/app")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "sqlite:")
	assert.Contains(t, stderr, "mysql://")
	assert.Contains(t, stderr, "unknown scheme")
	assert.NotContains(t, stderr, "hunter2")
}

// A sqlite: URL naming a file that does not exist says so, and creates nothing.
func TestCommand_sqliteMissingFileSaysSo(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nosuch.db")
	code, _, stderr := sqlbrokerCmd(t, nil, "inspect", "-url", "sqlite:"+path)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "no such file")
	assert.Contains(t, stderr, "mode=rwc")
	_, err := os.Stat(path)
	assert.ErrorIs(t, err, fs.ErrNotExist, "the command created the file")
}
