#!/usr/bin/env bash
# Make sure redis-server and redis-cli (7.0 or newer) are on PATH; install them when we can.
set -euo pipefail
have() { command -v redis-server >/dev/null && command -v redis-cli >/dev/null; }
major() { redis-server --version | sed -E 's/.*v=([0-9]+).*/\1/'; }
if have && [ "$(major)" -ge 7 ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "redis-server 7+ not found: installing it with apt-get" >&2
    # a failure (no network, no such package) falls through to the message below
    apt-get -o DPkg::Lock::Timeout=600 update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq redis-server redis-tools >/dev/null || true
    have && [ "$(major)" -ge 7 ] && exit 0
fi
cat >&2 <<'MSG'
shardlb needs redis-server and redis-cli, version 7.0 or newer, on PATH.
Install them, then run the command again:
  Debian/Ubuntu:  sudo apt-get install redis-server redis-tools
  Fedora:         sudo dnf install redis
  macOS:          brew install redis
MSG
exit 1
