# The test database: PostgreSQL with trust auth (see CONTRIBUTING.md).
SQLBROKER_TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
export SQLBROKER_TEST_POSTGRES_URL

.PHONY: test test-race test-universal test-reconnect pgbouncer chaos-soak fuzz bench example

# Everything CI runs.
test: pgbouncer test-race test-universal test-reconnect

# Two PgBouncers in front of the test database (session pooling on 6432, transaction pooling
# on 6433) for the pooler tests of ./tests; the script installs Debian's pgbouncer when it can.
# Without them those tests are skipped, except in CI (CI=true), where they fail.
pgbouncer:
	@bash .ci/pgbouncer.sh || echo "PgBouncer not started: the PgBouncer tests will be skipped (CI fails them)"

# Every package under the race detector, one package at a time (the chaos suite holds the
# xmin horizon back and terminates connections: run beside the others it would slow them
# down). The chaos suite (tests/chaos) appends its totals to
# chaos-totals.txt, printed here: go test shows nothing else of a passing package.
test-race:
	go vet ./...
	go -C cmd/sqlbroker-bench vet ./...
	rm -f chaos-totals.txt
	SQLBROKER_CHAOS_TOTALS=$(CURDIR)/chaos-totals.txt go test -race -count=1 -p 1 -timeout 20m -skip 'TestUniversal_' ./...; \
		status=$$?; cat chaos-totals.txt 2>/dev/null; exit $$status

# The chaos suite for longer: publish and inject faults for 10 minutes per claim mode.
chaos-soak:
	go test -race -count=1 -timeout 60m -v -run TestChaos ./tests/chaos/ -chaos.soak=10m

# Watermill's universal suites (both drivers, both claim modes, and the ordered
# configuration), one test at a time: under -race on two cores, the 50-subscriber tests slow
# the test running beside them past the suite's fixed 15 s read windows (each passes alone).
test-universal:
	go test -race -count=1 -parallel 1 -timeout 60m -run 'TestUniversal_' ./tests/

# Watermill's TestReconnect restarts PostgreSQL. It runs in its own pass, alone, and without
# -race: the universal suite's TestReconnect reads a slice its own goroutine appends to
# without synchronisation, which the race detector reports whatever Pub/Sub runs it.
test-reconnect:
	go test -count=1 -timeout 10m -run 'TestUniversal_[A-Za-z]+/[a-z]+/TestReconnect' ./tests/

fuzz:
	go test -run '^$$' -fuzz FuzzValidateName -fuzztime 30s ./internal/ident/
	go test -run '^$$' -fuzz FuzzNewTables -fuzztime 30s ./internal/offsets/

bench:
	go test -run '^$$' -bench . -benchtime 20000x ./tests/

example:
	go run ./_examples/basic
