package dbx

// PIDsRemembered counts the entries of the backend pid cache of database/sql connections.
func PIDsRemembered() int {
	n := 0
	pids.Range(func(any, any) bool { n++; return true })
	return n
}

const MaxPIDs = maxPIDs

const MaxStmtsPerConn = maxStmtsPerConn

// SQLitePrepares counts the statements p has prepared.
func SQLitePrepares(p *SQLitePool) int64 { return p.prep.prepares.Load() }
