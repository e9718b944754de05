# The test database: SQLBROKER_TEST_POSTGRES_URL, by default
# postgres://postgres@127.0.0.1:5432/test?sslmode=disable (trust auth; see CONTRIBUTING.md).

.PHONY: test test-race test-universal test-reconnect chaos-soak fuzz bench example

# The tests each pass runs (go test -run patterns). Narrower ones take a few tests through
# the whole of `make test`, e.g. RACE_TESTS='TestX' UNIVERSAL_TESTS='^$$'.
RACE_TESTS ?= .
UNIVERSAL_TESTS ?= TestUniversal_
RECONNECT_TESTS ?= TestUniversal_[A-Za-z]+/[a-z]+/TestReconnect

# Everything CI runs, around a database of its own when needed: .ci/testenv.sh uses the server
# at SQLBROKER_TEST_POSTGRES_URL, or when that is not set and nothing usable answers at the
# default URL (or with SQLBROKER_TEST_THROWAWAY=1), starts a throwaway PostgreSQL from the
# installed server binaries; with two throwaway PgBouncers in front of it (session and
# transaction pooling) when pgbouncer is installed; and stops them all at the end.
test:
	@bash .ci/testenv.sh $(MAKE) --no-print-directory test-race test-universal test-reconnect

# Every package under the race detector, one package at a time (the chaos suite holds the
# xmin horizon back and terminates connections: run beside the others it would slow them
# down). The chaos suite (tests/chaos) appends its totals to
# chaos-totals.txt, printed here: go test shows nothing else of a passing package. The
# migration from watermill-sql is tested in a module of its own (tests/migrate), so that the
# library's module does not require watermill-sql. A top-level test that fails is run once
# more, alone (.ci/gotest-rerun.sh): the pass fails unless it passes then, and the log lists
# those that passed only then as FLAKY, to be mended.
test-race:
	go vet ./...
	go -C cmd/sqlbroker-bench vet ./...
	go -C tests/migrate vet ./...
	go -C tests/migrate test -race -count=1 -timeout 10m -run '$(RACE_TESTS)' ./...
	rm -f chaos-totals.txt
	SQLBROKER_CHAOS_TOTALS=$(CURDIR)/chaos-totals.txt bash .ci/gotest-rerun.sh -race -count=1 -p 1 -timeout 20m -run '$(RACE_TESTS)' -skip 'TestUniversal_' ./...; \
		status=$$?; cat chaos-totals.txt 2>/dev/null; exit $$status

# The chaos suite for longer: publish and inject faults for 10 minutes per claim mode.
chaos-soak:
	go test -race -count=1 -timeout 60m -v -run TestChaos ./tests/chaos/ -chaos.soak=10m

# Watermill's universal suites (both drivers, both claim modes, and the ordered
# configuration), one test at a time: under -race on two cores, the 50-subscriber tests slow
# the test running beside them past the suite's fixed 15 s read windows (each passes alone).
# A failed top-level test is run once more, as in the race pass.
# The race detector instruments modernc.org/sqlite's engine too (Go translated from C), which
# makes SQLite's statements about 30 times slower: TestConcurrentSubscribe (50 consumer groups
# of 5,000 messages) takes about 125 s under it on SQLite, 4 s without. It runs under -race
# through Open, where each subscriber has a pool of its own, and without -race on the caller's
# pool; every other test of the suite runs under -race in both.
SQLITE_NORACE = TestUniversal_SQLite/sqldb/TestConcurrentSubscribe$$
test-universal:
	bash .ci/gotest-rerun.sh -race -count=1 -parallel 1 -timeout 60m -run '$(UNIVERSAL_TESTS)' -skip '$(SQLITE_NORACE)' ./tests/
ifeq ($(UNIVERSAL_TESTS),TestUniversal_)
	go test -count=1 -timeout 10m -run '$(SQLITE_NORACE)' ./tests/
endif

# Watermill's TestReconnect restarts PostgreSQL. It runs in its own pass, alone, and without
# -race: the universal suite's TestReconnect reads a slice its own goroutine appends to
# without synchronisation, which the race detector reports whatever Pub/Sub runs it. Under
# `make test`, it restarts only a server the test run started, or any in CI, or with
# SQLBROKER_TEST_RESTART_COMMAND set; otherwise .ci/testenv.sh sets SQLBROKER_TEST_NO_RESTART.
test-reconnect:
ifdef SQLBROKER_TEST_NO_RESTART
	@echo "reconnect pass skipped: $(SQLBROKER_TEST_NO_RESTART)"
else
	go test -count=1 -timeout 10m -run '$(RECONNECT_TESTS)' ./tests/
endif

fuzz:
	go test -run '^$$' -fuzz FuzzValidateName -fuzztime 30s ./internal/ident/
	go test -run '^$$' -fuzz FuzzNewTables -fuzztime 30s ./internal/offsets/

bench:
	go test -run '^$$' -bench . -benchtime 20000x ./tests/

example:
	go run ./_examples/basic
