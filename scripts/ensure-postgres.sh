#!/usr/bin/env bash
# Make sure PostgreSQL's server programs (initdb, pg_ctl) are here for the archive's private server,
# unless SHARDLB_POSTGRES_URL names a server to use instead; install them when we can.
set -euo pipefail
[ -n "${SHARDLB_POSTGRES_URL:-}" ] && exit 0
have() { command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }
# The initdb shardlb/postgres.py runs: on PATH, else the newest /usr/lib/postgresql/<version>/bin.
initdb_bin() { command -v initdb 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1; }
# The archive's schema needs PostgreSQL 14 (CREATE OR REPLACE TRIGGER); an older one is named here,
# not left to fail the archiver's set-up with a syntax error.
recent() {
    local bin major
    bin=$(initdb_bin)
    major=$("$bin" --version | grep -oE '[0-9]+' | head -1)
    [ "${major:-0}" -ge 14 ] && return 0
    echo "$bin is PostgreSQL ${major:-of an unknown version}: shardlb's archive needs 14 or newer." >&2
    echo "Install a newer one (https://www.postgresql.org/download/), or point SHARDLB_POSTGRES_URL at a server of 14 or newer." >&2
    exit 1
}
if have; then recent; exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "PostgreSQL's initdb not found: installing postgresql with apt-get" >&2
    # a failure (no network, no such package) falls through to the message below
    apt-get -o DPkg::Lock::Timeout=600 update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq postgresql >/dev/null || true
    have && recent && exit 0
fi
cat >&2 <<'MSG'
shardlb keeps every result in PostgreSQL and starts a private server of its own (initdb, pg_ctl).
Install PostgreSQL's server programs, then run the command again:
  Debian/Ubuntu:  sudo apt-get install postgresql
  Fedora:         sudo dnf install postgresql-server
  macOS:          brew install postgresql
or point SHARDLB_POSTGRES_URL at a server you have (postgresql://user@host:port/db).
MSG
exit 1
