package sqlbroker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Defaults of KeyRepositoryConfig.
const (
	DefaultKeyTable  = "sqlbroker_dedup_keys"
	DefaultKeyWindow = time.Minute
	// keyPruneBatch bounds the keys one pruning statement deletes.
	keyPruneBatch = 10000
	// maxKeyTableLength leaves room for the suffixes of the table's index and key names.
	maxKeyTableLength = ident.MaxIdentifierLength - len("_pkey")
)

// KeyRepositoryConfig configures a KeyRepository.
type KeyRepositoryConfig struct {
	// Schema is the PostgreSQL schema of the table ("" for the search_path; must be "" on
	// SQLite).
	Schema string

	// Table names the repository's table: lower-case ASCII letters, digits and _, at most 58
	// bytes. Defaults to DefaultKeyTable. Repositories of different windows want tables of
	// their own.
	Table string

	// Window is how long a key is remembered: a key seen again within Window of its first
	// sighting is a duplicate; after it, the key counts as new again. Defaults to
	// DefaultKeyWindow; at least a millisecond.
	Window time.Duration

	// PruneInterval is how often a background goroutine deletes expired keys (at most
	// 10,000 per statement, until none is left). Defaults to Window, at least a second;
	// negative disables it (then prune with Prune, or with the command's retention -keys).
	// Expired keys never count as duplicates, pruned or not: pruning only bounds the table.
	PruneInterval time.Duration

	// InitializeSchema creates the table on first use when it does not exist (see
	// KeyRepositorySchemaSQL). Without it, the first use checks that the table exists.
	InitializeSchema bool

	// Logger receives the errors of background pruning. Defaults to no logging.
	Logger watermill.LoggerAdapter
}

func (c *KeyRepositoryConfig) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultKeyTable
	}
	if c.Window == 0 {
		c.Window = DefaultKeyWindow
	}
	if c.PruneInterval == 0 {
		c.PruneInterval = max(c.Window, time.Second)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c *KeyRepositoryConfig) validate(d dbx.Dialect) error {
	if err := validateIdentifier("Schema", c.Schema, maxSchemaNameLength, true); err != nil {
		return err
	}
	if err := schemaOn(d, c.Schema); err != nil {
		return err
	}
	if err := validateIdentifier("Table", c.Table, maxKeyTableLength, false); err != nil {
		return err
	}
	if c.Window < time.Millisecond {
		return &ConfigError{Field: "Window", Value: c.Window, Reason: "must be at least 1ms"}
	}
	return nil
}

// KeyRepository remembers deduplication keys in a table of their own, on PostgreSQL or
// SQLite: Watermill's middleware.ExpiringKeyRepository for a middleware.Deduplicator shared
// by every consumer process on the database, where Watermill's own map repository is one
// per process.
//
// IsDuplicate writes a key that is absent or expired, to expire after Window, and reports
// whether the key was there unexpired: one statement, so that of two consumers checking one
// key at the same moment exactly one sees it as new. Used as the Deduplicator's Repository,
// the key is committed before the handler runs: a handler that then fails leaves the key
// behind, and the message's redelivery within Window is dropped as a duplicate. Where the key
// must commit with the handler's work, check it inside the handler's transaction with WithTx.
//
// Expired keys are deleted in the background (PruneInterval) until Close. It is safe for
// concurrent use.
type KeyRepository struct {
	pool   dbx.Pool
	table  offsets.KeyTable
	config KeyRepositoryConfig

	ready atomic.Bool // the table was found or created

	pruned    atomic.Int64
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

// NewKeyRepository builds a KeyRepository on db, which must wrap a pool (Pgx, StdSQL, SQLite or
// MySQL). It connects to nothing: the table is checked (or created, with
// InitializeSchema) on first use. Call Close to stop the background pruning.
func NewKeyRepository(db DB, config KeyRepositoryConfig) (*KeyRepository, error) {
	if err := db.refused(); err != nil {
		return nil, err
	}
	if db.pool == nil {
		return nil, &ConfigError{Field: "db", Value: "not a pool", Reason: "must wrap a pool: use sqlbroker.Pgx, sqlbroker.StdSQL, sqlbroker.SQLite or sqlbroker.MySQL (a transaction goes to WithTx)"}
	}
	config.setDefaults()
	if err := config.validate(db.dialect()); err != nil {
		return nil, err
	}
	r := &KeyRepository{
		pool:   db.pool,
		table:  offsets.NewKeyTable(db.dialect(), config.Schema, config.Table),
		config: config,
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	if config.PruneInterval > 0 {
		go r.pruneLoop()
	} else {
		close(r.done)
	}
	return r, nil
}

// KeyRepositorySchemaSQL returns the DDL of a KeyRepository's table on PostgreSQL, for
// migration tools: what InitializeSchema runs. schema and table are those of the
// KeyRepositoryConfig ("" for the search_path and DefaultKeyTable). The statements are
// idempotent.
func KeyRepositorySchemaSQL(schema, table string) (string, error) {
	c := KeyRepositoryConfig{Schema: schema, Table: table}
	c.setDefaults()
	if err := c.validate(dbx.Postgres); err != nil {
		return "", err
	}
	return offsets.NewKeyTable(dbx.Postgres, c.Schema, c.Table).SchemaSQL(), nil
}

// KeyRepositorySQLiteSchemaSQL is KeyRepositorySchemaSQL for SQLite.
func KeyRepositorySQLiteSchemaSQL(table string) (string, error) {
	c := KeyRepositoryConfig{Table: table}
	c.setDefaults()
	if err := c.validate(dbx.SQLite); err != nil {
		return "", err
	}
	return offsets.NewKeyTable(dbx.SQLite, "", c.Table).SchemaSQL(), nil
}

// IsDuplicate reports whether key was seen within the window; if not, it remembers it from
// now on. It implements middleware.ExpiringKeyRepository.
func (r *KeyRepository) IsDuplicate(ctx context.Context, key string) (bool, error) {
	if err := r.ensure(ctx, nil); err != nil {
		return false, err
	}
	wrote, err := r.table.Claim(ctx, r.pool, []byte(key), r.config.Window)
	if err != nil {
		return false, fmt.Errorf("sqlbroker: key repository %s: %w", r.table.Table, err)
	}
	return !wrote, nil
}

// WithTx returns the repository working inside the caller's transaction tx (PgxTx, StdTx or
// SQLiteTx, on the repository's database): the key it writes commits or rolls back with tx,
// together with the handler's own writes and, with AckInTx, the message's ack. A key that
// another transaction is writing and has not committed makes IsDuplicate wait for that
// transaction on PostgreSQL (SQLite has one writer at a time): it is a duplicate if that
// transaction commits, and new if it rolls back.
func (r *KeyRepository) WithTx(tx DB) *KeyRepositoryTx {
	return &KeyRepositoryTx{r: r, q: tx.tx}
}

// KeyRepositoryTx is a KeyRepository inside a caller's transaction (see WithTx). It
// implements middleware.ExpiringKeyRepository.
type KeyRepositoryTx struct {
	r *KeyRepository
	q dbx.Querier
}

// IsDuplicate is KeyRepository.IsDuplicate inside the transaction.
func (t *KeyRepositoryTx) IsDuplicate(ctx context.Context, key string) (bool, error) {
	if t.q == nil {
		return false, &ConfigError{Field: "tx", Value: "not a transaction", Reason: "must wrap the caller's transaction: use sqlbroker.PgxTx, sqlbroker.StdTx, sqlbroker.SQLiteTx or sqlbroker.MySQLTx"}
	}
	if err := t.r.ensure(ctx, t.q); err != nil {
		return false, err
	}
	wrote, err := t.r.table.Claim(ctx, t.q, []byte(key), t.r.config.Window)
	if err != nil {
		return false, fmt.Errorf("sqlbroker: key repository %s: %w", t.r.table.Table, err)
	}
	return !wrote, nil
}

// ensure checks, or creates, the table until a check or a creation on the pool succeeds.
// Inside a caller's transaction (q set) it runs on q alone, never on another connection of
// the pool (the caller's transactions may hold every one): a table it creates there commits
// with q, so it is checked again next time.
func (r *KeyRepository) ensure(ctx context.Context, q dbx.Querier) error {
	if r.ready.Load() {
		return nil
	}
	var err error
	switch {
	case q != nil:
		err = r.table.Check(ctx, q)
		if errors.Is(err, offsets.ErrNoKeyTable) && r.config.InitializeSchema {
			return r.wrapErr(r.table.CreateIn(ctx, q))
		}
	case r.config.InitializeSchema:
		err = r.table.Create(ctx, r.pool)
	default:
		err = r.table.Check(ctx, r.pool)
	}
	if err != nil {
		return r.wrapErr(err)
	}
	r.ready.Store(true)
	return nil
}

func (r *KeyRepository) wrapErr(err error) error {
	if errors.Is(err, offsets.ErrNoKeyTable) {
		return fmt.Errorf("sqlbroker: key repository: %w: set InitializeSchema: true, or create it with the SQL of sqlbroker.KeyRepositorySchemaSQL in a migration", err)
	}
	if err != nil {
		return fmt.Errorf("sqlbroker: key repository %s: %w", r.table.Table, err)
	}
	return nil
}

// Prune deletes the expired keys, in statements of up to 10,000, and returns how many it
// deleted.
func (r *KeyRepository) Prune(ctx context.Context) (int64, error) {
	if err := r.ensure(ctx, nil); err != nil {
		return 0, err
	}
	var total int64
	for {
		var n int64
		err := dbx.InTx(ctx, r.pool, func(tx dbx.Tx) error {
			// Bounded on the server where it can be: a statement in flight is awaited by
			// Close, never cut.
			if err := dbx.SetTxTimeouts(ctx, tx, DefaultAdminStatementTimeout.Milliseconds(), dbx.TxAccessAsIs); err != nil {
				return err
			}
			var err error
			n, err = r.table.Prune(ctx, tx, keyPruneBatch)
			return err
		})
		total += n
		r.pruned.Add(n)
		if err != nil {
			return total, fmt.Errorf("sqlbroker: key repository %s: pruning: %w", r.table.Table, err)
		}
		if n < keyPruneBatch {
			return total, nil
		}
	}
}

// Pruned is the number of expired keys this repository's Prune calls and background pruning
// deleted.
func (r *KeyRepository) Pruned() int64 { return r.pruned.Load() }

func (r *KeyRepository) pruneLoop() {
	defer close(r.done)
	t := time.NewTicker(r.config.PruneInterval)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
		}
		// Not cut by Close: Close waits for the statement, which the server bounds.
		ctx, cancel := context.WithTimeout(context.Background(), 2*DefaultAdminStatementTimeout)
		if _, err := r.Prune(ctx); err != nil {
			r.config.Logger.Error("Pruning expired deduplication keys failed", err, watermill.LogFields{"table": r.table.Table})
		}
		cancel()
	}
}

// Close stops the background pruning, waiting for a pruning statement in flight to end. It
// closes nothing else: the pool is the caller's. It is idempotent.
func (r *KeyRepository) Close() error {
	r.closeOnce.Do(func() { close(r.stop) })
	<-r.done
	return nil
}
