#!/usr/bin/env bash
# PostgreSQL and Redis on loopback for the tests (no Docker), from Debian's postgresql and redis-server.
#
#   scripts/services.sh install                    # apt-get installs the missing packages, pgvector where
#                                                  # offered (CI does this)
#   scripts/services.sh installed postgres|redis   # exit status 0 when that package is installed
#   eval "$(scripts/services.sh start [postgres] [redis])"   # start them (default both), export their URLs
#   scripts/services.sh stop [postgres] [redis]
#
# Both run from a scratch folder ($CHATLOOM_SERVICES_DIR, default /tmp/chatloom-services) on their own
# ports ($CHATLOOM_PG_PORT, default 55432; $CHATLOOM_REDIS_PORT, default 56379), so a system-wide
# PostgreSQL or Redis is left alone; `stop` stops only the servers of that folder. A server of that
# folder that already runs is reused. As root, PostgreSQL runs as the postgres user (initdb refuses
# root). Messages go to stderr; stdout carries only the export lines. `make test` (scripts/test.sh)
# uses this with a fresh folder and free ports of its own.
set -euo pipefail

DIR="${CHATLOOM_SERVICES_DIR:-/tmp/chatloom-services}"
PG_PORT="${CHATLOOM_PG_PORT:-55432}"
REDIS_PORT="${CHATLOOM_REDIS_PORT:-56379}"

say() { echo "services: $*" >&2; }

installed() {
  case "$1" in
    postgres) ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 ;;
    redis) command -v redis-server >/dev/null && command -v redis-cli >/dev/null ;;
    *) echo "services: unknown service '$1' (postgres or redis)" >&2; return 2 ;;
  esac
}

install_missing() {
  local need=()
  installed postgres || need+=(postgresql)
  installed redis || need+=(redis-server)
  local sudo=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2
  fi
  # pgvector, for vector search inside PostgreSQL (docs/files.md); where the distribution has no package
  # for this PostgreSQL (Debian 12 has none), the tests of it skip and search stays exact in the gateway.
  if ! ls /usr/share/postgresql/*/extension/vector.control >/dev/null 2>&1; then
    local pkg; pkg="postgresql-$(basename "$(dirname "$(pg_bin)")")-pgvector"
    [ ${#need[@]} -gt 0 ] || $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    if apt-cache show "$pkg" >/dev/null 2>&1; then
      say "installing $pkg"
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-upgrade "$pkg" >&2
    else
      say "no $pkg package here: vector search on PostgreSQL stays exact in the gateway"
    fi
  fi
}

pg_bin() { ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1; }

as_pg() {  # run a command as the cluster's owner
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start_postgres() {
  local bin; bin="$(pg_bin)"
  mkdir -p "$DIR"
  if [ "$(id -u)" = 0 ]; then mkdir -p "$DIR/pg" && chown postgres "$DIR/pg"; fi
  if [ ! -s "$DIR/pg/data/PG_VERSION" ]; then
    as_pg "$bin/initdb" -D "$DIR/pg/data" -U chatloom -A trust --no-sync >/dev/null
  fi
  if ! as_pg "$bin/pg_ctl" -D "$DIR/pg/data" status >/dev/null 2>&1; then
    # Test data is scratch: no fsync. Sockets stay inside the scratch folder.
    as_pg "$bin/pg_ctl" -D "$DIR/pg/data" -l "$DIR/pg/log" -w -t 60 start \
      -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $DIR/pg -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" >&2
  fi
  as_pg "$bin/psql" -h 127.0.0.1 -p "$PG_PORT" -U chatloom -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname='chatloom'" | grep -q 1 \
    || as_pg "$bin/createdb" -h 127.0.0.1 -p "$PG_PORT" -U chatloom chatloom
  say "postgresql on 127.0.0.1:$PG_PORT"
  echo "export CHATLOOM_TEST_POSTGRES_URL=postgresql://chatloom@127.0.0.1:$PG_PORT/chatloom"
}

start_redis() {
  mkdir -p "$DIR/redis"
  if ! redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
      --dir "$DIR/redis" --pidfile "$DIR/redis/redis.pid" --logfile "$DIR/redis/log" >&2
    for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  say "redis on 127.0.0.1:$REDIS_PORT"
  echo "export CHATLOOM_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
}

stop_postgres() {
  [ -s "$DIR/pg/data/PG_VERSION" ] || return 0
  as_pg "$(pg_bin)/pg_ctl" -D "$DIR/pg/data" -m fast stop >&2 || true
}

stop_redis() {  # by the folder's pid file, never by port: a Redis on that port may be someone else's
  local pidfile="$DIR/redis/redis.pid" pid
  [ -s "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  say "redis (pid $pid) did not stop"
}

command="${1:-start}"
[ $# -gt 0 ] && shift
services=("$@")
[ ${#services[@]} -eq 0 ] && services=(postgres redis)

case "$command" in
  install) install_missing ;;
  installed) for s in "${services[@]}"; do installed "$s" || exit 1; done ;;
  start)
    for s in "${services[@]}"; do
      installed "$s" || { echo "services: $s is not installed (scripts/services.sh install)" >&2; exit 1; }
    done
    for s in "${services[@]}"; do "start_$s"; done
    ;;
  stop) for s in "${services[@]}"; do if installed "$s"; then "stop_$s"; fi; done ;;
  *)
    echo "usage: $0 install | installed postgres|redis | start|stop [postgres] [redis]" >&2
    exit 2
    ;;
esac
