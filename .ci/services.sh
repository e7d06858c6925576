#!/usr/bin/env bash
# Start PostgreSQL and Redis on loopback for the tests (no Docker), and print the env vars the tests read.
#
#   eval "$(.ci/services.sh start)"   # installs Debian's postgresql/redis-server if missing, starts both
#   .ci/services.sh stop
#
# Both run from a scratch folder ($CHATLOOM_SERVICES_DIR, default /tmp/chatloom-services) on their own
# ports, so a system-wide PostgreSQL or Redis is left alone. As root, PostgreSQL runs as the postgres user
# (initdb refuses root). Messages go to stderr; stdout carries only the export lines.
set -euo pipefail

DIR="${CHATLOOM_SERVICES_DIR:-/tmp/chatloom-services}"
PG_PORT="${CHATLOOM_PG_PORT:-55432}"
REDIS_PORT="${CHATLOOM_REDIS_PORT:-56379}"

say() { echo "services: $*" >&2; }

install_missing() {
  local need=()
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  command -v redis-server >/dev/null || need+=(redis-server)
  [ ${#need[@]} -eq 0 ] && return
  local sudo=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi
  say "installing ${need[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2
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
}

start_redis() {
  mkdir -p "$DIR/redis"
  if ! redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
      --dir "$DIR/redis" --pidfile "$DIR/redis/redis.pid" --logfile "$DIR/redis/log" >&2
    for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  say "redis on 127.0.0.1:$REDIS_PORT"
}

case "${1:-start}" in
  start)
    install_missing
    start_postgres
    start_redis
    echo "export CHATLOOM_TEST_POSTGRES_URL=postgresql://chatloom@127.0.0.1:$PG_PORT/chatloom"
    echo "export CHATLOOM_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
    ;;
  stop)
    as_pg "$(pg_bin)/pg_ctl" -D "$DIR/pg/data" -m fast stop >&2 || true
    redis-cli -p "$REDIS_PORT" shutdown nosave >&2 || true
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
