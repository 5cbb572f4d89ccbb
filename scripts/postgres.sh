#!/usr/bin/env bash
# A private, throw-away PostgreSQL server for the fleet tests (listens on 127.0.0.1 only).
#
#   bash scripts/postgres.sh install      # Debian's postgresql package, when root and not yet installed
#   bash scripts/postgres.sh start DIR    # initdb DIR (once) and start it; prints the server's URL
#   bash scripts/postgres.sh stop DIR     # stop it and remove its data
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
    if [ ! -f "$dir/datadir" ]; then
        # as root, the server runs as user postgres, which may not reach DIR: keep its files in a
        # folder of its own and remember where
        if [ "$(id -u)" = 0 ]; then
            data="$(mktemp -d -t attnbench-pgdata.XXXXXX)"
            chown postgres "$data"
        else
            data="$dir/pg"
            mkdir -p "$data"
        fi
        echo "$data" >"$dir/datadir"
    fi
    data="$(cat "$dir/datadir")"
    if [ ! -f "$data/data/PG_VERSION" ]; then
        as_owner "$bin/initdb" -D "$data/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 \
            || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    as_owner "$bin/pg_ctl" -D "$data/data" -l "$data/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $data -c max_connections=200 -c fsync=off" start >/dev/null \
        || { tail -20 "$data/server.log" >&2; exit 1; }
    echo "postgresql://postgres@127.0.0.1:$port/postgres"
    ;;
stop)
    dir="${2:?usage: postgres.sh stop DIR}"
    bin="$(pg_bin)" || exit 0
    [ -f "$dir/datadir" ] || exit 0
    data="$(cat "$dir/datadir")"
    if [ -f "$data/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$data/data" -m fast -w stop >/dev/null
    fi
    case "$data" in "$dir"/*) ;; *) rm -rf "$data" ;; esac  # the root-case folder outside DIR
    rm -f "$dir/datadir"
    ;;
*)
    echo "usage: postgres.sh install | start DIR | stop DIR" >&2
    exit 2
    ;;
esac
