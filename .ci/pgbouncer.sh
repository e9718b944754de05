#!/usr/bin/env bash
# Starts two PgBouncers in front of the test PostgreSQL (127.0.0.1:5432, trust auth) for the
# pooler tests: session pooling on 127.0.0.1:6432, transaction pooling on 127.0.0.1:6433.
# Idempotent: an instance already listening is left alone. Installs Debian's pgbouncer when
# it is missing and apt-get is there.
set -euo pipefail

dir=${SQLBROKER_PGBOUNCER_DIR:-/tmp/sqlbroker-pgbouncer}
upstream_host=${SQLBROKER_PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}
upstream_port=${SQLBROKER_PGBOUNCER_UPSTREAM_PORT:-5432}

if ! command -v pgbouncer >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing pgbouncer"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
    # The package's own service is not the one the tests use.
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now pgbouncer >/dev/null 2>&1 || true; fi
  else
    echo "pgbouncer is not installed (apt-get install pgbouncer)" >&2
    exit 1
  fi
fi

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
serves_test_db() { psql -h 127.0.0.1 -p "$1" -U postgres -d test -Atqc 'SELECT 1' >/dev/null 2>&1; }

# The package's own instance (listening on 6432 with no database configured) is not ours.
if listening 6432 && ! serves_test_db 6432; then
  if [ -x /etc/init.d/pgbouncer ]; then /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true; fi
  for _ in $(seq 30); do listening 6432 || break; sleep 0.1; done
fi

mkdir -p "$dir"
# pgbouncer refuses to run as root: it runs as postgres when started by root.
run_as=()
if [ "$(id -u)" = 0 ]; then
  chown postgres "$dir" 2>/dev/null || true
  run_as=(-u postgres)
fi
printf '"postgres" ""\n' >"$dir/userlist.txt"

for spec in session:6432 transaction:6433; do
  mode=${spec%%:*}
  port=${spec##*:}
  if listening "$port"; then
    serves_test_db "$port" || { echo "127.0.0.1:$port is taken by something that does not serve the test database" >&2; exit 1; }
    continue
  fi
  cat >"$dir/$mode.ini" <<EOF
[databases]
* = host=$upstream_host port=$upstream_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = $mode
max_client_conn = 500
default_pool_size = 40
ignore_startup_parameters = extra_float_digits
logfile = $dir/$mode.log
pidfile = $dir/$mode.pid
application_name_add_host = 0
EOF
  [ "$(id -u)" = 0 ] && chown postgres "$dir/$mode.ini" "$dir/userlist.txt" 2>/dev/null || true
  pgbouncer -d "${run_as[@]}" "$dir/$mode.ini"
  for _ in $(seq 50); do listening "$port" && break; sleep 0.1; done
  serves_test_db "$port" || { echo "pgbouncer ($mode) did not start on $port; see $dir/$mode.log" >&2; exit 1; }
  echo "pgbouncer ($mode pooling) on 127.0.0.1:$port"
done
