package sqlbroker

import (
	"context"
	"sync"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// storeCache holds one offsets.Store a topic: its prepared statements, kept once its tables
// were created or checked.
type storeCache struct {
	dialect        dbx.Dialect // of the database the tables are in
	schema, prefix string
	asyncCommit    bool

	mu    sync.Mutex
	ready map[string]*offsets.Store
}

func newStoreCache(d dbx.Dialect, schema, prefix string, asyncCommit bool) *storeCache {
	return &storeCache{dialect: d, schema: schema, prefix: prefix, asyncCommit: asyncCommit, ready: map[string]*offsets.Store{}}
}

// tables names the tables of topic, on the database of t.
func (t *storeCache) tables(topic string) offsets.Tables {
	return tablesOn(t.dialect, t.schema, t.prefix, topic)
}

// tablesOn names the tables of topic in a database of dialect d.
func tablesOn(d dbx.Dialect, schema, prefix, topic string) offsets.Tables {
	return offsets.NewTables(schema, prefix, topic).On(d)
}

// cached returns the statements of topic when an earlier call of store has checked its tables.
func (t *storeCache) cached(topic string) *offsets.Store {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ready[topic]
}

// store validates topic and returns its statements. The first call for a topic creates the
// tables (initialize) or checks that they exist with this schema version: through pool (a
// pool or one of its connections), or q alone inside a caller's transaction (pool nil).
func (t *storeCache) store(ctx context.Context, pool dbx.Beginner, q dbx.Querier, topic string, initialize bool) (*offsets.Store, error) {
	if err := validateName("topic", topic); err != nil {
		return nil, err
	}
	t.mu.Lock()
	s, ok := t.ready[topic]
	t.mu.Unlock()
	if ok {
		return s, nil
	}
	tables := t.tables(topic)
	var err error
	switch {
	case initialize && pool != nil:
		err = tables.Create(ctx, pool)
	case initialize:
		// Inside the caller's transaction, the catalog is read first, as on a pool: the DDL
		// takes table locks (CREATE INDEX IF NOT EXISTS a SHARE lock, COMMENT ON a SHARE
		// UPDATE EXCLUSIVE one) and the schema advisory lock, all held until the caller
		// commits, so every other writer of the topic would wait for that commit, and two
		// transactions touching topics in opposite orders could deadlock. Only missing
		// tables are created, and then the DDL joins the caller's transaction.
		err = tables.Check(ctx, q)
		if offsets.IsMissing(err) {
			err = tables.CreateIn(ctx, q)
		}
	default:
		err = tables.Check(ctx, q)
	}
	if err != nil {
		return nil, publicErr(err)
	}
	s = offsets.NewStore(tables, t.asyncCommit)
	t.mu.Lock()
	t.ready[topic] = s
	t.mu.Unlock()
	return s, nil
}

// forget drops the cached state of topic, so that the next use checks its tables again.
func (t *storeCache) forget(topic string) {
	t.mu.Lock()
	delete(t.ready, topic)
	t.mu.Unlock()
}
