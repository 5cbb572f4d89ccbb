#!/usr/bin/env bash
# The project's test command (README and .ci/run): start a private PostgreSQL for the fleet tests,
# then run pytest with any arguments given. Where PostgreSQL cannot be had (no package, not root),
# the fleet tests are skipped with that reason and everything else runs.
set -euo pipefail
cd "$(dirname "$0")/.."

if bash scripts/postgres.sh install; then
    pg_dir="$(mktemp -d -t attnbench-pg.XXXXXX)"
    trap 'bash scripts/postgres.sh stop "$pg_dir" || true; rm -rf "$pg_dir"' EXIT
    if url="$(bash scripts/postgres.sh start "$pg_dir")"; then
        export ATTNBENCH_TEST_POSTGRES="$url"
        echo "PostgreSQL for the fleet tests: $url"
    else
        export ATTNBENCH_TEST_POSTGRES_UNAVAILABLE="the PostgreSQL server did not start (see scripts/postgres.sh)"
    fi
else
    export ATTNBENCH_TEST_POSTGRES_UNAVAILABLE="PostgreSQL is not installed and could not be installed here"
fi
python -m pytest "$@"
