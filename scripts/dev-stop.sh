#!/usr/bin/env bash
# `make stop`: stop the router that `make run` started (SIGTERM: it drains accepted writes first),
# then the local cluster. Safe to run when nothing runs. `--router-only` leaves the cluster up.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=.shardlb
PID_FILE=$STATE/router.pid

if [ -f "$PID_FILE" ]; then
    pid=$(cat "$PID_FILE")
    # Only our router: after a reboot the pid may belong to anything.
    if kill -0 "$pid" 2>/dev/null && ps -p "$pid" -o command= | grep -q "router.server"; then
        kill -TERM "$pid"
        for _ in $(seq 1 150); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "router $pid did not stop within 30 s: killing it" >&2
            kill -KILL "$pid"
        fi
        echo "router stopped"
    fi
    rm -f "$PID_FILE"
fi

[ "${1:-}" = "--router-only" ] && exit 0

if [ -f "$STATE/cluster/state.json" ]; then
    if [ -x .venv/bin/python ]; then
        .venv/bin/python -m shardlb cluster down --dir "$STATE/cluster"
    else
        echo "no .venv: cannot stop the cluster in $STATE/cluster (run make install, then make stop)" >&2
        exit 1
    fi
fi
