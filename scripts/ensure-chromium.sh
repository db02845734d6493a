#!/usr/bin/env bash
# Make sure Debian's chromium is at /usr/bin/chromium for the dashboard's browser test
# (tests/test_dashboard_browser.py drives it with Playwright; Playwright's own browser download is
# never used). Installs it with apt-get when we are root; otherwise says how, and the test skips.
set -euo pipefail
BROWSER=/usr/bin/chromium
if [ -x "$BROWSER" ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "$BROWSER not found: installing Debian's chromium with apt-get" >&2
    # a failure (no network, no such package) falls through to the message below
    apt-get -o DPkg::Lock::Timeout=600 update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null || true
    [ -x "$BROWSER" ] && exit 0
fi
cat >&2 <<'MSG'
The dashboard's browser test needs Chromium at /usr/bin/chromium (Debian's `chromium` package):
  Debian/Ubuntu:  sudo apt-get install chromium
Without it that one test is skipped; everything else runs.
MSG
exit 0
