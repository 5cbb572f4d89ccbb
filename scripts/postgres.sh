#!/usr/bin/env bash
# A private, throw-away PostgreSQL server for the fleet tests (listens on 127.0.0.1 only).
#
#   bash scripts/postgres.sh install      # Debian's postgresql package, when root and not yet installed
#   bash scripts/postgres.sh start DIR    # initdb DIR (once) and start it; prints the server's URL
#   bash scripts/postgres.sh stop DIR     # stop it (DIR stays; remove it to start fresh)
#
# The server trusts local connections (it is for tests: 127.0.0.1 and a socket inside DIR only) and
# picks a free port. Exit status 3 from `start` means PostgreSQL cannot be had here (no binaries).
set -euo pipefail

pg_bin() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
        [ -x "$d/initdb" ] && { echo "$d"; return 0; }
    done
    command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
    return 1
}

# run a server binary as a user it accepts (initdb and postgres refuse root)
as_owner() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

cmd="${1:-}"
case "$cmd" in
install)
    if pg_bin >/dev/null; then
        exit 0  # already installed: nothing to do
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "postgres.sh: PostgreSQL is not installed and this is not a root Debian shell; install the" \
            "'postgresql' package to run the fleet tests" >&2
        exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
    ;;
start)
    dir="${2:?usage: postgres.sh start DIR}"
    bin="$(pg_bin)" || { echo "postgres.sh: no PostgreSQL binaries (initdb) found" >&2; exit 3; }
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
    if [ ! -f "$dir/data/PG_VERSION" ]; then
        as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 \
            || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c max_connections=200 -c fsync=off" start >/dev/null \
        || { tail -20 "$dir/server.log" >&2; exit 1; }
    echo "$port" >"$dir/port"
    echo "postgresql://postgres@127.0.0.1:$port/postgres"
    ;;
stop)
    dir="${2:?usage: postgres.sh stop DIR}"
    bin="$(pg_bin)" || exit 0
    [ -f "$dir/data/postmaster.pid" ] || exit 0
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    ;;
*)
    echo "usage: postgres.sh install | start DIR | stop DIR" >&2
    exit 2
    ;;
esac
