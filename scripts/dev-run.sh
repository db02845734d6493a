#!/usr/bin/env bash
# `make run`: a local Redis Cluster (3 masters, 1 replica each), a `demo` board and the router on
# :8000 in the background. Keys and the cluster's port block are made once, kept in .shardlb/dev.env
# and reused; running it again restarts the router (new code) and keeps the cluster and its data.
# `make stop` (scripts/dev-stop.sh) stops both.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=.shardlb
CLUSTER_DIR=$STATE/cluster
ENV_FILE=$STATE/dev.env
PID_FILE=$STATE/router.pid
LOG=$STATE/router.log
ARCHIVE_PID_FILE=$STATE/archive.pid
ARCHIVE_LOG=$STATE/archive.log
PY=.venv/bin/python
HOST=127.0.0.1
PORT=${SHARDLB_PORT:-8000}
BOARD=demo
mkdir -p "$STATE"
# A PostgreSQL the user names; dev.env's SHARDLB_POSTGRES_URL (sourced below) is only what the last
# run used, often our own server, which `make stop` stopped and this run must start again. A shell
# that sourced dev.env (README's first session) exports that URL too: it names no server either.
GIVEN_POSTGRES_URL=${SHARDLB_POSTGRES_URL:-}
if [ -n "$GIVEN_POSTGRES_URL" ] && [ -f "$STATE/postgres/postgres.json" ] &&
    [ "$GIVEN_POSTGRES_URL" = "$("$PY" -c 'import json, sys; from shardlb.postgres import local_url
print(local_url(json.load(open(sys.argv[1]))["port"]))' "$STATE/postgres/postgres.json")" ]; then
    GIVEN_POSTGRES_URL=
fi

# VAR VALUE kept in dev.env (in place of an earlier value): the shell that sources it has what the
# `shardlb` commands of README need, the cluster's and PostgreSQL's URLs with the keys.
remember() {
    ( umask 077; { grep -v "^$1=" "$ENV_FILE" || true; echo "$1=$2"; } >"$ENV_FILE.tmp" )
    mv "$ENV_FILE.tmp" "$ENV_FILE"
}

# A free block of 6 ports (and their bus ports, +10000) from $1 on, never 6379.
free_block() { "$PY" -c "from shardlb.cluster import free_port_block; print(free_port_block(6, $1))"; }

# SHARDLB_CLUSTER_PORT given: where a first run's block of cluster ports starts (7000 when not).
GIVEN_CLUSTER_PORT=${SHARDLB_CLUSTER_PORT:-}
if [ -n "$GIVEN_CLUSTER_PORT" ] && { ! [[ $GIVEN_CLUSTER_PORT =~ ^[0-9]{1,5}$ ]] ||
    [ "$GIVEN_CLUSTER_PORT" -lt 1024 ] || [ "$GIVEN_CLUSTER_PORT" -gt 55530 ]; }; then
    echo "SHARDLB_CLUSTER_PORT=$GIVEN_CLUSTER_PORT is not a port from 1024 to 55530 (6 nodes, each with" \
        "its bus port 10000 above it)" >&2
    exit 1
fi
# As bash read it (07000 is 7000): the Python that looks for a free block refuses a leading zero.
[ -z "$GIVEN_CLUSTER_PORT" ] || GIVEN_CLUSTER_PORT=$((10#$GIVEN_CLUSTER_PORT))

if [ ! -f "$ENV_FILE" ]; then
    admin=$("$PY" -c 'import secrets; print("admin_" + secrets.token_urlsafe(24))')
    write=$("$PY" -c 'import secrets; print("write_" + secrets.token_urlsafe(24))')
    ( umask 077; cat >"$ENV_FILE" <<EOF
# Made by scripts/dev-run.sh on the first \`make run\` and reused since; delete it for new keys.
SHARDLB_ADMIN_KEYS=$admin
SHARDLB_WRITE_KEYS=$write
EOF
    )
fi
# The cluster's block of ports: chosen once (a first run, or the line deleted with the cluster), and
# again from the port given when no cluster is kept in $CLUSTER_DIR (its state file is there from
# the first `cluster up` on, across `make stop`): README's "delete .shardlb/cluster for an empty
# cluster" then takes SHARDLB_CLUSTER_PORT as a first run does, where dev.env's block was kept.
kept=true
if ! grep -q "^SHARDLB_CLUSTER_PORT=" "$ENV_FILE" ||
    { [ -n "$GIVEN_CLUSTER_PORT" ] && [ ! -f "$CLUSTER_DIR/state.json" ]; }; then
    kept=false
    # Its own assignment, so that a failure stops the run (inside remember's arguments it went
    # unseen, and dev.env kept an empty port, which every later run took for the cluster's).
    block=$(free_block "${GIVEN_CLUSTER_PORT:-7000}")
    remember SHARDLB_CLUSTER_PORT "$block"
fi
set -a
# shellcheck source=/dev/null
. "$ENV_FILE"
set +a

# The cluster: `cluster up` finds it running, restarts what died, or forms it afresh. When another
# process took our ports before the cluster was first formed, move to a free block and remember it
# (from the port given, when the block taken was dev.env's: nothing of it is kept). A cluster formed
# once keeps its data on its ports and cannot move: `cluster up` says what to do.
taken=
if ! up=$("$PY" -m shardlb cluster up --durable --dir "$CLUSTER_DIR" --port "$SHARDLB_CLUSTER_PORT" 2>&1); then
    if ! grep -q "pick another --port" <<<"$up"; then
        echo "$up" >&2
        exit 1
    fi
    taken=$SHARDLB_CLUSTER_PORT
    from=$((taken + 6))
    if $kept && [ -n "$GIVEN_CLUSTER_PORT" ]; then from=$GIVEN_CLUSTER_PORT; fi
    moved=$(free_block "$from")
    echo "ports from $taken are taken by another process: the cluster moves to $moved" >&2
    sed -i.bak "s/^SHARDLB_CLUSTER_PORT=.*/SHARDLB_CLUSTER_PORT=$moved/" "$ENV_FILE" && rm -f "$ENV_FILE.bak"
    SHARDLB_CLUSTER_PORT=$moved
    up=$("$PY" -m shardlb cluster up --durable --dir "$CLUSTER_DIR" --port "$SHARDLB_CLUSTER_PORT")
fi
# Said once the cluster is up, of the ports it took: before, a run said the cluster kept its data
# on dev.env's block and then moved it to another.
if [ -n "$GIVEN_CLUSTER_PORT" ] && [ "$GIVEN_CLUSTER_PORT" != "$SHARDLB_CLUSTER_PORT" ]; then
    if $kept && [ -z "$taken" ]; then
        echo "SHARDLB_CLUSTER_PORT=$GIVEN_CLUSTER_PORT is not used: the cluster of $CLUSTER_DIR keeps" \
            "its data on ports from $SHARDLB_CLUSTER_PORT ($ENV_FILE): make stop, then delete" \
            "$CLUSTER_DIR, for an empty cluster on the ports given" >&2
    elif [ "$taken" != "$GIVEN_CLUSTER_PORT" ]; then
        echo "ports from $GIVEN_CLUSTER_PORT are taken by another process: the cluster takes" \
            "$SHARDLB_CLUSTER_PORT" >&2
    fi
fi
SHARDLB_REDIS_URL=$(sed -n 's/^SHARDLB_REDIS_URL=//p' <<<"$up")
export SHARDLB_REDIS_URL

# PostgreSQL, the archive's source of truth: SHARDLB_POSTGRES_URL when given, else our own server.
SHARDLB_POSTGRES_URL=$GIVEN_POSTGRES_URL
if [ -z "$SHARDLB_POSTGRES_URL" ]; then
    pg=$("$PY" -m shardlb postgres up --dir "$STATE/postgres")
    SHARDLB_POSTGRES_URL=$(sed -n 's/^SHARDLB_POSTGRES_URL=//p' <<<"$pg")
elif ! refused=$("$PY" - "$SHARDLB_POSTGRES_URL" 2>&1 <<'EOF'
import sys
import psycopg
try:
    psycopg.connect(sys.argv[1], connect_timeout=5).close()
except psycopg.Error as e:
    sys.exit(str(e).strip())
EOF
); then
    # The archiver would wait for it for ever while this says shardlb is running.
    echo "the PostgreSQL of SHARDLB_POSTGRES_URL ($SHARDLB_POSTGRES_URL) does not answer: $refused" >&2
    echo "start it, or unset SHARDLB_POSTGRES_URL for a private server of make run's own" >&2
    exit 1
fi
export SHARDLB_POSTGRES_URL
remember SHARDLB_REDIS_URL "$SHARDLB_REDIS_URL"
remember SHARDLB_POSTGRES_URL "$SHARDLB_POSTGRES_URL"

# The archiver beside the router: restarted like it (the journals wait for it meanwhile).
bash scripts/dev-stop.sh --archiver-only
echo "--- $(date -u +%FT%TZ) make run" >>"$ARCHIVE_LOG"
nohup "$PY" -m shardlb archive --redis "$SHARDLB_REDIS_URL" --postgres "$SHARDLB_POSTGRES_URL" \
    </dev/null >>"$ARCHIVE_LOG" 2>&1 &
echo $! >"$ARCHIVE_PID_FILE"

# The router: restart ours if it runs; refuse if someone else holds the port.
bash scripts/dev-stop.sh --router-only
# SO_REUSEADDR as uvicorn sets it: the connections of a router just stopped do not count.
if ! "$PY" -c "import socket as so; s = so.socket(); s.setsockopt(so.SOL_SOCKET, so.SO_REUSEADDR, 1)
s.bind(('$HOST', $PORT))" 2>/dev/null; then
    echo "port $PORT on $HOST is taken by another process; free it or run: SHARDLB_PORT=8001 make run" >&2
    exit 1
fi
URL="http://$HOST:$PORT"
# The router's URL beside the keys: README's first session reads it, whichever port this run took.
# Written before the router starts: a shell that sources dev.env meanwhile reaches this router,
# which refuses its connections until it is ready. Without the line the sessions take :8000, which
# may be another checkout's router (401), and the last run's line names the router just stopped.
remember SHARDLB_API_URL "$URL"
echo "--- $(date -u +%FT%TZ) make run" >>"$LOG"
SHARDLB_HOST=$HOST SHARDLB_PORT=$PORT nohup "$PY" -m router.server serve </dev/null >>"$LOG" 2>&1 &
echo $! >"$PID_FILE"

"$PY" - "$URL" "$LOG" <<'EOF' || { echo "the router did not become ready; last lines of its log:" >&2; tail -n 20 "$LOG" >&2; exit 1; }
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(1)
EOF

created=$("$PY" - "$URL/v1/boards/$BOARD" "$SHARDLB_ADMIN_KEYS" <<'EOF'
import json, sys, urllib.error, urllib.request
url, key = sys.argv[1], sys.argv[2].split(",")[0]
body = json.dumps({"periods": ["total", "daily", "weekly", "monthly"]}).encode()
request = urllib.request.Request(url, body, method="PUT", headers={
    "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=10) as r:
        print("created" if r.status == 201 else "already there")
except urllib.error.HTTPError as e:
    print(f"exists with other settings ({e.code})" if e.code == 409 else f"not created: HTTP {e.code}")
EOF
)

cat <<EOF

shardlb is running (router pid $(cat "$PID_FILE"), archiver pid $(cat "$ARCHIVE_PID_FILE"))
  API        $URL        OpenAPI: $URL/openapi.json   metrics: $URL/metrics
  dashboard  $URL/dashboard   (sign in with the admin key below)
  board      $BOARD ($created)
  admin key  $SHARDLB_ADMIN_KEYS
  write key  $SHARDLB_WRITE_KEYS
  cluster    $SHARDLB_REDIS_URL
  archive    $SHARDLB_POSTGRES_URL (every result; shardlb archive runs beside the router)
  files      keys in $ENV_FILE, logs in $LOG and $ARCHIVE_LOG, nodes in $CLUSTER_DIR
  stop       make stop

Try it (router/README.md has a longer first session):
  curl -s -X POST $URL/v1/boards/$BOARD/scores -H 'Authorization: Bearer $SHARDLB_WRITE_KEYS' \\
       -H 'Content-Type: application/json' \\
       -d '{"scores": [{"player_id": "42", "points": 1520, "match_id": "match-1"}]}'
  curl -s $URL/v1/boards/$BOARD/top
EOF
