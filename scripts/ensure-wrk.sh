#!/usr/bin/env bash
# Make sure wrk (the HTTP load generator of `make bench`'s hot reads, bench/hot.py) is on PATH:
# Debian's package, installed with apt-get when we are root. Without it the hot phase is skipped.
set -euo pipefail
if command -v wrk >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "wrk not found: install Debian's wrk (apt-get install wrk); make bench skips its hot reads without it" >&2
  exit 0
fi
echo "wrk not found: installing Debian's wrk with apt-get"
if ! apt-get -o DPkg::Lock::Timeout=600 install -y -q wrk >/dev/null 2>&1; then
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null 2>&1 || true
  apt-get -o DPkg::Lock::Timeout=600 install -y -q wrk >/dev/null 2>&1 || echo "could not install wrk; make bench skips its hot reads" >&2
fi
