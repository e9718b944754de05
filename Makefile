# The test database: PostgreSQL with trust auth (see CONTRIBUTING.md).
SQLBROKER_TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
export SQLBROKER_TEST_POSTGRES_URL

.PHONY: test test-race test-reconnect fuzz bench example

# Everything CI runs.
test: test-race test-reconnect

# Every package under the race detector.
test-race:
	go vet ./...
	go test -race -count=1 -timeout 20m ./...

# Watermill's TestReconnect restarts PostgreSQL. It runs in its own pass, alone, and without
# -race: the universal suite's TestReconnect reads a slice its own goroutine appends to
# without synchronisation, which the race detector reports whatever Pub/Sub runs it.
test-reconnect:
	go test -count=1 -timeout 10m -run 'TestUniversal_[A-Za-z]+/[a-z]+/TestReconnect' ./tests/

fuzz:
	go test -run '^$$' -fuzz FuzzValidateName -fuzztime 30s ./internal/ident/

bench:
	go test -run '^$$' -bench . -benchtime 20000x ./tests/

example:
	go run ./_examples/basic
