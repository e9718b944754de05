package dbx

import (
	"runtime"
	"sync"
	"weak"
)

// PoolFacts remembers facts about pools (that a pool's connections are server sessions of
// their own, say) for as long as each pool lives: a pool is known by its underlying pgx pool
// or *sql.DB, whatever wraps it, and held by a weak reference, so that a pool the program
// drops is forgotten. A pool of another kind is never remembered.
type PoolFacts struct {
	m sync.Map // weak.Pointer[pgxpool.Pool] or weak.Pointer[sql.DB] -> struct{}
}

// Has reports whether Set was called for pool.
func (f *PoolFacts) Has(pool Pool) bool {
	k := weakKey(pool)
	if k == nil {
		return false
	}
	_, ok := f.m.Load(k)
	return ok
}

// Set remembers the fact for pool.
func (f *PoolFacts) Set(pool Pool) {
	switch p := pool.(type) {
	case *PgxPool:
		remember(f, p.Pool)
	case *StdPool:
		remember(f, p.DB)
	}
}

func remember[T any](f *PoolFacts, p *T) {
	k := weak.Make(p)
	if _, had := f.m.LoadOrStore(k, struct{}{}); !had {
		runtime.AddCleanup(p, func(k weak.Pointer[T]) { f.m.Delete(k) }, k)
	}
}

func weakKey(pool Pool) any {
	switch p := pool.(type) {
	case *PgxPool:
		return weak.Make(p.Pool)
	case *StdPool:
		return weak.Make(p.DB)
	}
	return nil
}
