#!/usr/bin/env bash
# Runs a command (make test's passes) against a test database, and leaves nothing of its own
# behind: usage `bash .ci/testenv.sh COMMAND [ARG...]`.
#
# PostgreSQL: the server at SQLBROKER_TEST_POSTGRES_URL when it is set. Otherwise the one at
# the default URL, postgres://postgres@127.0.0.1:5432/test?sslmode=disable, when the tests can
# connect to it and its max_connections is at least 300 (the universal suites open many
# connections at once); else (or with SQLBROKER_TEST_THROWAWAY=1) a throwaway server from the
# installed server binaries (initdb and pg_ctl, on PATH or under SQLBROKER_TEST_PG_BINDIRS), in
# a temporary directory: trust auth, a free port, max_connections 300, stopped and removed at
# the end, also on failure or Ctrl-C. As root, it runs as the user postgres (or nobody).
#
# MySQL: see the end of the script.
#
# PgBouncer: two throwaway instances on free ports in front of the test database, in session
# and transaction pooling, passed to the tests in SQLBROKER_TEST_PGBOUNCER_SESSION_URL and
# SQLBROKER_TEST_PGBOUNCER_TRANSACTION_URL (unless those are set). pgbouncer is installed
# (Debian's package) in CI only; elsewhere, without it, the PgBouncer tests are skipped.
#
# Restarts: the reconnect pass (and the chaos suite's restart, SQLBROKER_CHAOS_RESTART=1)
# restart the throwaway server when one runs. A server this script did not start is restarted
# only in CI (CI=true: the CI machine's own) or by a SQLBROKER_TEST_RESTART_COMMAND of the
# user's; otherwise SQLBROKER_TEST_NO_RESTART tells make to skip the reconnect pass.
set -euo pipefail

# One block, read whole before it runs: a checkout that changes this file during a run does
# not change the run.
{
if [ $# = 0 ]; then
  echo "usage: bash .ci/testenv.sh COMMAND [ARG...]" >&2
  exit 2
fi

default_url='postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
user_url=${SQLBROKER_TEST_POSTGRES_URL:-}
force=${SQLBROKER_TEST_THROWAWAY:-}
bindirs=${SQLBROKER_TEST_PG_BINDIRS-/usr/lib/postgresql/*/bin /usr/pgsql-*/bin /opt/homebrew/opt/postgresql*/bin /usr/local/opt/postgresql*/bin}

say() { printf 'testenv: %s\n' "$*"; }
die() { printf 'testenv: %s\n' "$*" >&2; exit 1; }

if [ -n "$force" ] && [ "$force" != 1 ] && [ "$force" != 0 ]; then
  die "SQLBROKER_TEST_THROWAWAY is 1 (start a throwaway server) or unset, not $force"
fi
if [ "$force" = 1 ] && [ -n "$user_url" ]; then
  die "SQLBROKER_TEST_THROWAWAY=1 starts a server of its own: unset SQLBROKER_TEST_POSTGRES_URL, or unset SQLBROKER_TEST_THROWAWAY to test the server it names"
fi

# The server binaries: the directory of initdb on PATH, else the newest of the directories
# of SQLBROKER_TEST_PG_BINDIRS (glob patterns) that hold both initdb and pg_ctl.
bindir=
if p=$(command -v initdb 2>/dev/null) && [ -x "${p%/*}/pg_ctl" ]; then
  bindir=${p%/*}
else
  found=()
  for d in $bindirs; do
    [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && found+=("$d")
  done
  if [ ${#found[@]} -gt 0 ]; then
    bindir=$(printf '%s\n' "${found[@]}" | sort -rV | head -1)
  fi
fi
tool() { # tool NAME: the client program NAME, from PATH or beside the server binaries
  if command -v "$1" >/dev/null 2>&1; then command -v "$1"
  elif [ -n "$bindir" ] && [ -x "$bindir/$1" ]; then echo "$bindir/$1"
  else return 1; fi
}
psql=$(tool psql || true)
q() { # q URL SQL: one value, or the error on stderr
  PGCONNECT_TIMEOUT=5 "$psql" -X -w -Atq -d "$1" -c "$2"
}

# Which server: the user's, the default one, or a throwaway one (and why).
url=
why=
if [ -n "$user_url" ]; then
  url=$user_url
elif [ "$force" = 1 ]; then
  why="SQLBROKER_TEST_THROWAWAY=1"
elif [ -n "$psql" ]; then
  if ! out=$(q "$default_url" 'SHOW max_connections' 2>&1); then
    why="no usable server at $default_url ($(printf '%s' "$out" | head -1))"
  elif [ "$out" -lt 300 ] && [ -n "$bindir" ]; then
    why="the server at $default_url has max_connections $out, and the universal suites need 300"
  else
    url=$default_url
  fi
elif (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
  url=$default_url # no psql to check it with: the tests will tell
else
  why="nothing answers at $default_url"
fi

if [ -z "$url" ] && [ -z "$bindir" ]; then
  printf '%s\n' "testenv: $why, and no PostgreSQL server binaries (initdb and pg_ctl) were found on PATH or under ${bindirs:-(no directory)} to start a throwaway server for the tests. Install PostgreSQL 13 or newer and run make test again: it then starts a server of its own for the run and stops it at the end (Debian/Ubuntu: sudo apt-get install postgresql; macOS: brew install postgresql). Or start one in a container, at the default URL: docker run -d --name sqlbroker-pg -p 127.0.0.1:5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust -e POSTGRES_DB=test postgres:17 -c max_connections=300 (CONTRIBUTING.md, \"A database\"). Or set SQLBROKER_TEST_POSTGRES_URL to a server of yours." >&2
  exit 1
fi

# Everything of the run lives in one directory, removed at the end.
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/sqlbroker-test.XXXXXX")
pg_started=
bouncers=()

# initdb, pg_ctl and pgbouncer refuse to run as root: as root, they run as postgres (or
# nobody), in a directory that user owns.
as_user=()
if [ "$(id -u)" = 0 ]; then
  user=postgres
  id -u "$user" >/dev/null 2>&1 || user=nobody
  chown "$user" "$run_dir"
  if command -v runuser >/dev/null 2>&1; then as_user=(runuser -u "$user" --)
  else as_user=(su -s /bin/sh "$user" -c '"$0" "$@"'); fi
fi
as() { (cd "$run_dir" && ${as_user[@]+"${as_user[@]}"} "$@"); }

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() { # a port nothing listens on, below the ephemeral ports of Linux and macOS (the
  # caller retries when another process took it first)
  local port
  while :; do
    port=$((20000 + RANDOM % 12000))
    listening "$port" || { echo "$port"; return; }
  done
}

cleanup() {
  local status=$?
  # A second Ctrl-C must not cut the cleanup short (pg_ctl and kill inherit the ignore).
  trap - EXIT
  trap '' INT TERM
  local pidfile pid
  for pidfile in ${bouncers[@]+"${bouncers[@]}"}; do
    pid=$(cat "$pidfile" 2>/dev/null) || continue
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  if [ -n "$pg_started" ]; then
    if ! as "$bindir/pg_ctl" -D "$run_dir/data" -m fast -w -t 30 stop >/dev/null 2>&1; then
      as "$bindir/pg_ctl" -D "$run_dir/data" -m immediate -w -t 30 stop >/dev/null 2>&1 || true
    fi
    say "stopped the throwaway PostgreSQL"
  fi
  rm -rf "$run_dir"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -z "$url" ]; then
  say "$why: starting a throwaway PostgreSQL ($bindir)"
  as "$bindir/initdb" -D "$run_dir/data" -U postgres -A trust -E UTF8 --no-locale -N >"$run_dir/initdb.log" 2>&1 ||
    { cat "$run_dir/initdb.log" >&2; die "initdb failed"; }
  # The settings the suites need (max_connections: the universal suites open many connections
  # at once); no fsync: nothing of this server outlives the run.
  echo "include 'testenv.conf'" >>"$run_dir/data/postgresql.conf"
  pg_started=1 # from here on, cleanup stops whatever pg_ctl started
  for try in 1 2 3 4 5; do
    port=$(free_port)
    cat >"$run_dir/data/testenv.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$run_dir'
max_connections = 300
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
    as "$bindir/pg_ctl" -D "$run_dir/data" -l "$run_dir/postgres.log" -w -t 60 start >/dev/null && break
    grep -q 'could not bind\|already in use' "$run_dir/postgres.log" 2>/dev/null && [ "$try" -lt 5 ] && continue
    tail -20 "$run_dir/postgres.log" >&2 || true
    die "the throwaway PostgreSQL did not start"
  done
  [ -n "$psql" ] || die "no psql on PATH or in $bindir, to create the test database"
  "$psql" -X -w -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -c 'CREATE DATABASE test'
  url="postgres://postgres@127.0.0.1:$port/test?sslmode=disable"
  export SQLBROKER_TEST_POSTGRES_URL=$url

  # The restart of the reconnect pass and of the chaos suite. The reconnect pass calls it from
  # several tests at once: under a file lock, a call that finds a restart running waits for
  # that one and counts it as its own (as the default command of tests/universal_test.go).
  restart=$run_dir/restart
  {
    echo '#!/bin/sh'
    echo '# Restarts the throwaway PostgreSQL of a test run; calls that overlap share one restart.'
    printf 'if [ "${1:-}" = now ]; then cd %q && exec %s %q -D %q -l %q -w -t 60 -m fast restart; fi\n' \
      "$run_dir" "$(printf '%q ' ${as_user[@]+"${as_user[@]}"})" "$bindir/pg_ctl" "$run_dir/data" "$run_dir/postgres.log"
    printf 'lock=%q\n' "$run_dir/restart.lock"
    echo 'if command -v flock >/dev/null; then flock -n -o -E 75 "$lock" "$0" now || { [ $? = 75 ] && flock "$lock" true; }; exit; fi'
    echo 'if mkdir "$lock.d" 2>/dev/null; then "$0" now; s=$?; rmdir "$lock.d"; exit $s; fi'
    echo 'while [ -d "$lock.d" ]; do sleep 0.1; done'
  } >"$restart"
  chmod 755 "$restart"
  export SQLBROKER_TEST_RESTART_COMMAND=$restart SQLBROKER_CHAOS_RESTART_COMMAND=$restart
  say "throwaway PostgreSQL $("$bindir/postgres" -V | awk '{print $3}') at $url (restarted by $restart)"
else
  if [ -n "$user_url" ]; then say "PostgreSQL at SQLBROKER_TEST_POSTGRES_URL"; else say "PostgreSQL at $url"; fi
  export SQLBROKER_TEST_POSTGRES_URL=$url
  if [ -z "$psql" ]; then
    :
  elif ! max=$(q "$url" 'SHOW max_connections' 2>&1); then
    say "warning: the tests cannot connect to it ($(printf '%s' "$max" | head -1))"
  elif [ "$max" -lt 300 ]; then
    say "warning: its max_connections is $max; the universal suites need 300 (CONTRIBUTING.md, \"A database\")"
  fi
  if [ -z "${SQLBROKER_TEST_RESTART_COMMAND:-}" ] && [ "${CI:-}" != true ]; then
    export SQLBROKER_TEST_NO_RESTART="it restarts the server, and this one was not started by the test run (set SQLBROKER_TEST_RESTART_COMMAND to a command that restarts it, or SQLBROKER_TEST_THROWAWAY=1 to test against a throwaway server)"
  fi
fi

# MariaDB and NATS: when tests of theirs exist, their throwaway servers start here, beside
# PostgreSQL's, and stop in cleanup.

# The PgBouncers, in front of the test database.
start_bouncers() {
  local modes=() mode
  for mode in session transaction; do
    local var=SQLBROKER_TEST_PGBOUNCER_$(tr a-z A-Z <<<"$mode")_URL
    if [ -n "${!var:-}" ]; then say "PgBouncer ($mode pooling) at $var"; else modes+=("$mode"); fi
  done
  [ ${#modes[@]} -gt 0 ] || return 0
  local pgbouncer
  pgbouncer=$(command -v pgbouncer || { [ -x /usr/sbin/pgbouncer ] && echo /usr/sbin/pgbouncer; } || true)
  if [ -z "$pgbouncer" ] && [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing pgbouncer"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
    pgbouncer=/usr/sbin/pgbouncer
  fi
  if [ -z "$pgbouncer" ]; then
    say "pgbouncer is not installed: the PgBouncer tests are skipped (Debian/Ubuntu: apt-get install pgbouncer; macOS: brew install pgbouncer)"
    return
  fi
  [ -n "$psql" ] || { say "no psql: the PgBouncer tests are skipped"; return 1; }
  # Where the test database is, as the server sees it.
  local row host port db dbuser
  row=$(q "$url" "SELECT coalesce(host(inet_server_addr()), ''), inet_server_port(), current_database(), current_user" 2>&1) ||
    { say "the test database did not answer: $row"; return 1; }
  IFS='|' read -r host port db dbuser <<<"$row"
  if [ -z "$host" ] || ! [[ "$db$dbuser" =~ ^[A-Za-z0-9_]+$ ]]; then
    say "the PgBouncer tests need the test database over TCP, with a plain database and user name"
    return 1
  fi
  printf '"%s" ""\n' "$dbuser" >"$run_dir/userlist.txt"
  local bport
  for mode in "${modes[@]}"; do
    for try in 1 2 3 4 5; do
      bport=$(free_port)
      cat >"$run_dir/pgbouncer-$mode.ini" <<EOF
[databases]
* = host=$host port=$port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bport
unix_socket_dir =
auth_type = trust
auth_file = $run_dir/userlist.txt
pool_mode = $mode
max_client_conn = 500
default_pool_size = 40
ignore_startup_parameters = extra_float_digits
logfile = $run_dir/pgbouncer-$mode.log
pidfile = $run_dir/pgbouncer-$mode.pid
application_name_add_host = 0
EOF
      as "$pgbouncer" -d "$run_dir/pgbouncer-$mode.ini" >/dev/null 2>&1 || true
      for _ in $(seq 50); do [ -s "$run_dir/pgbouncer-$mode.pid" ] && listening "$bport" && break; sleep 0.1; done
      [ -s "$run_dir/pgbouncer-$mode.pid" ] && break
    done
    bouncers+=("$run_dir/pgbouncer-$mode.pid")
    local burl="postgres://$dbuser@127.0.0.1:$bport/$db?sslmode=disable"
    q "$burl" 'SELECT 1' >/dev/null 2>&1 || {
      tail -5 "$run_dir/pgbouncer-$mode.log" 2>/dev/null
      say "pgbouncer ($mode pooling) did not start"
      return 1
    }
    export "SQLBROKER_TEST_PGBOUNCER_$(tr a-z A-Z <<<"$mode")_URL=$burl"
    say "throwaway PgBouncer ($mode pooling) at $burl"
  done
}
if ! start_bouncers; then
  [ "${CI:-}" = true ] && die "no PgBouncer: CI fails the PgBouncer tests"
  say "the PgBouncer tests are skipped"
fi

# MySQL or MariaDB: the server at SQLBROKER_TEST_MYSQL_DSN when it is set; otherwise the one at
# 127.0.0.1:3306 (database test, user root without a password), when something answers there.
# Without one the MySQL tests are skipped, except in CI, which fails.
if [ -z "${SQLBROKER_TEST_MYSQL_DSN:-}" ] && ! (exec 3<>/dev/tcp/127.0.0.1/3306) 2>/dev/null; then
  [ "${CI:-}" = true ] && die "no MySQL or MariaDB at 127.0.0.1:3306: CI runs the MySQL tests"
  say "no MySQL or MariaDB answers at 127.0.0.1:3306: the MySQL tests are skipped (set SQLBROKER_TEST_MYSQL_DSN to test one)"
  export SQLBROKER_TEST_MYSQL_DSN=off
fi

# Not exec: the trap stops what the run started once the command ends.
set +e
"$@"
status=$?
set -e
exit $status
}
