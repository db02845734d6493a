#!/usr/bin/env bash
# `make stop`: stop the router that `make run` started (SIGTERM: it drains accepted writes first),
# the archiver, then the local cluster and the private PostgreSQL. Safe to run when nothing runs.
# `--router-only` / `--archiver-only` stop just that process and leave the rest up.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=.shardlb

# Whether PID runs. One that has exited and is not yet reaped (a zombie) has stopped: `make run`'s
# processes outlive their shell, and the init that reaps them may take its time (1.7 s each in a
# container whose init reaps orphans now and then, where `make stop` waited for it).
running() {
    kill -0 "$1" 2>/dev/null && [[ $(ps -o stat= -p "$1" 2>/dev/null) != Z* ]]
}

# stop NAME PID_FILE PATTERN: SIGTERM the pid in PID_FILE if it is still our process (after a
# reboot the pid may belong to anything), wait up to 30 s, then SIGKILL.
stop() {
    local name=$1 pid_file=$2 pattern=$3 pid
    [ -f "$pid_file" ] || return 0
    pid=$(cat "$pid_file")
    if kill -0 "$pid" 2>/dev/null && ps -ww -p "$pid" -o command= | grep -q -- "$pattern"; then
        kill -TERM "$pid"
        for _ in $(seq 1 150); do
            running "$pid" || break
            sleep 0.2
        done
        if running "$pid"; then
            echo "$name $pid did not stop within 30 s: killing it" >&2
            kill -KILL "$pid"
        fi
        echo "$name stopped"
    fi
    rm -f "$pid_file"
}

case "${1:-}" in
--router-only) stop router "$STATE/router.pid" "router.server"; exit 0 ;;
--archiver-only) stop archiver "$STATE/archive.pid" "shardlb archive"; exit 0 ;;
esac
stop router "$STATE/router.pid" "router.server"
stop archiver "$STATE/archive.pid" "shardlb archive"

if [ ! -x .venv/bin/python ]; then
    if [ -f "$STATE/cluster/state.json" ] || [ -f "$STATE/postgres/postgres.json" ]; then
        echo "no .venv: cannot stop the cluster or PostgreSQL in $STATE (run make install, then make stop)" >&2
        exit 1
    fi
    exit 0
fi
if [ -f "$STATE/cluster/state.json" ]; then
    .venv/bin/python -m shardlb cluster down --dir "$STATE/cluster"
fi
if [ -f "$STATE/postgres/postgres.json" ]; then
    .venv/bin/python -m shardlb postgres down --dir "$STATE/postgres"
fi
