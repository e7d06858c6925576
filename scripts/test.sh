#!/usr/bin/env bash
# `make test`: the test suite, with throwaway PostgreSQL and Redis where Debian's packages are installed,
# so it runs what CI runs (.ci/run installs the packages, then calls `make test`).
#
# A service whose URL is already set (CHATLOOM_TEST_POSTGRES_URL, CHATLOOM_TEST_REDIS_URL) is used as
# it is and left running. Otherwise, where its package is installed, scripts/services.sh starts one in
# a fresh scratch folder on a free loopback port (CHATLOOM_SERVICES_DIR, CHATLOOM_PG_PORT and
# CHATLOOM_REDIS_PORT override them) and stops it when the tests end, passed or failed. Without the
# package, those tests skip, naming the package to install. First, scripts/dependency_audit.py checks the
# pinned dependencies for known vulnerabilities. Arguments go to pytest; $PY is the Python that runs it
# (default .venv/bin/python). The exit status is the audit's if it failed, else pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

started=()
if [ -z "${CHATLOOM_TEST_POSTGRES_URL:-}" ] && scripts/services.sh installed postgres; then started+=(postgres); fi
if [ -z "${CHATLOOM_TEST_REDIS_URL:-}" ] && scripts/services.sh installed redis; then started+=(redis); fi

if [ ${#started[@]} -gt 0 ]; then
  scratch=""
  if [ -z "${CHATLOOM_SERVICES_DIR:-}" ]; then
    scratch="$(mktemp -d /tmp/chatloom-test-services.XXXXXX)"
    chmod 755 "$scratch"  # as root, PostgreSQL runs as the postgres user, which must reach its folder
    export CHATLOOM_SERVICES_DIR="$scratch"
  fi
  export CHATLOOM_PG_PORT="${CHATLOOM_PG_PORT:-$(free_port)}"
  export CHATLOOM_REDIS_PORT="${CHATLOOM_REDIS_PORT:-$(free_port)}"
  cleanup() {
    scripts/services.sh stop "${started[@]}" || true
    if [ -n "$scratch" ]; then rm -rf "$scratch"; fi
  }
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  exports="$(scripts/services.sh start "${started[@]}")"  # a failed start stops here (set -e)
  eval "$exports"
fi

# Known vulnerabilities in the pinned dependencies fail the run; without network it only says so.
"$PY" scripts/dependency_audit.py
"$PY" -m pytest -q -p no:cacheprovider "$@"
