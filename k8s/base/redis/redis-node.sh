#!/usr/bin/env bash
# Start one Redis Cluster node: one pod of the redis-cluster StatefulSet.
#
# Node identity lives in $REDIS_DATA_DIR/nodes.conf on the pod's persistent volume, so a pod that
# is rescheduled keeps its node id, its slots and its data (AOF). What it does not keep is its IP:
# Redis Cluster's bus only speaks IP addresses, and nodes.conf remembers the peers' old ones. When
# every pod restarts at once (node drain, cluster upgrade, power loss) nobody can reach anybody at
# the addresses it remembers. So every node announces a stable DNS name (cluster-announce-hostname,
# the pod's name under the headless Service) and this script
#   1. before starting Redis, rewrites the peers' addresses in nodes.conf to what their names
#      resolve to now (its own to REDIS_ANNOUNCE_IP), keeping a copy in nodes.conf.bak;
#   2. while Redis runs, checks every few seconds for peers that are disconnected or failing,
#      resolves their names again and sends CLUSTER MEET to the new address when it changed (Redis
#      then updates the known node's address in place: same node id, same slots). This covers DNS
#      that lags behind the pods, and a single pod that moves while the others stay up.
#
# Clients must authenticate: REDIS_PASSWORD (the redis-auth Secret) becomes requirepass, and
# masterauth so that replicas authenticate to their masters. It is handed to redis-server on its
# standard input, not on the command line.
#
# Settings (environment):
#   REDIS_ANNOUNCE_HOSTNAME  required: this node's stable name (pod-N.<headless service>)
#   REDIS_PASSWORD           required: the password clients and replicas give; letters, digits and
#                            . _ ~ - only, because the router takes it unescaped inside its redis:// URL
#   REDIS_ANNOUNCE_IP        the pod's IP (downward API); announced on the cluster bus
#   REDIS_PORT               client port (6379); the bus port is REDIS_PORT + 10000
#   REDIS_BIND               addresses to listen on ("* -::*": every IPv4 and IPv6 address)
#   REDIS_DATA_DIR           data directory: AOF, nodes.conf (/data)
#   REDIS_MAXMEMORY          e.g. 768mb; 0 = no limit
#   REDIS_MAXMEMORY_POLICY   noeviction: a full shard refuses writes rather than drop scores
#   REDIS_CLUSTER_NODE_TIMEOUT  ms before a peer is suspected down (5000)
#   REDIS_APPENDFSYNC        everysec (at most ~1 s of acknowledged writes lost on a crash)
#   REDIS_REJOIN_INTERVAL    seconds between checks for moved peers (5)
#   REDIS_EXTRA_ARGS         more redis-server arguments, space-separated
#   REDIS_SERVER             redis-server binary (redis-server on PATH)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=redis-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/redis-lib.sh"

: "${REDIS_ANNOUNCE_HOSTNAME:?set REDIS_ANNOUNCE_HOSTNAME to the stable DNS name of this node}"
: "${REDIS_PASSWORD:?set REDIS_PASSWORD (the redis-auth Secret): the nodes never run without AUTH}"
[[ $REDIS_PASSWORD =~ ^[A-Za-z0-9._~-]+$ ]] ||
    die "REDIS_PASSWORD may hold only letters, digits and . _ ~ - (e.g. openssl rand -hex 32):" \
        "the router takes it unescaped in its redis:// URL"
REDIS_ANNOUNCE_IP="${REDIS_ANNOUNCE_IP:-}"
REDIS_PORT="${REDIS_PORT:-6379}"
REDIS_BIND="${REDIS_BIND:-* -::*}"
REDIS_DATA_DIR="${REDIS_DATA_DIR:-/data}"
REDIS_MAXMEMORY="${REDIS_MAXMEMORY:-0}"
REDIS_MAXMEMORY_POLICY="${REDIS_MAXMEMORY_POLICY:-noeviction}"
REDIS_CLUSTER_NODE_TIMEOUT="${REDIS_CLUSTER_NODE_TIMEOUT:-5000}"
REDIS_APPENDFSYNC="${REDIS_APPENDFSYNC:-everysec}"
REDIS_REJOIN_INTERVAL="${REDIS_REJOIN_INTERVAL:-5}"
REDIS_EXTRA_ARGS="${REDIS_EXTRA_ARGS:-}"
REDIS_SERVER="${REDIS_SERVER:-redis-server}"
NODES_CONF="$REDIS_DATA_DIR/nodes.conf"

# Point every peer in nodes.conf at the address its name resolves to now. Only the address part
# of a line changes; a name that does not resolve (yet) keeps its old address.
refresh_nodes_conf() {
    [[ -s $NODES_CONF ]] || return 0
    local tmp="$NODES_CONF.tmp.$$" line new changed=0
    local -a f
    while IFS= read -r line || [[ -n $line ]]; do
        read -r -a f <<<"$line"
        if ((${#f[@]} >= 8)) && [[ ${f[0]} != vars ]]; then
            split_node_address "${f[1]}"
            new=""
            if [[ ,${f[2]}, == *,myself,* ]]; then
                new=$REDIS_ANNOUNCE_IP
            elif [[ -n $NODE_HOSTNAME ]]; then
                new=$(resolve "$NODE_HOSTNAME")
            fi
            if [[ -n $new && $new != "$NODE_IP" ]]; then
                log "nodes.conf: ${NODE_HOSTNAME:-myself} (${f[0]:0:8}) $NODE_IP -> $new"
                f[1]="$new:$NODE_PORT@$NODE_CPORT$NODE_ADDR_SUFFIX"
                line="${f[*]}"
                changed=1
            fi
        fi
        printf '%s\n' "$line"
    done <"$NODES_CONF" >"$tmp"
    if ((changed)); then
        cp -p "$NODES_CONF" "$NODES_CONF.bak"
        mv -f "$tmp" "$NODES_CONF"
    else
        rm -f "$tmp"
    fi
}

# Runs beside redis-server for the life of the node; exits when the server is gone.
rejoin_loop() {
    local server_pid=$1 host nodes id addr flags new
    host=$(local_host)
    while sleep "$REDIS_REJOIN_INTERVAL"; do
        kill -0 "$server_pid" 2>/dev/null || exit 0
        nodes=$(rcli -h "$host" -p "$REDIS_PORT" cluster nodes 2>/dev/null) || continue
        while read -r id addr flags _ _ _ _ link _; do
            [[ -n ${id:-} && -n ${link:-} ]] || continue
            [[ ,$flags, == *,myself,* || ,$flags, == *,handshake,* ]] && continue
            # a connected, healthy peer has a good address: no DNS look-up for it
            if [[ $link == connected && ,$flags, != *,fail,* && ,$flags, != *,fail\?,* ]]; then
                continue
            fi
            split_node_address "$addr"
            [[ -n $NODE_HOSTNAME ]] || continue
            new=$(resolve "$NODE_HOSTNAME")
            [[ -n $new && $new != "$NODE_IP" ]] || continue
            log "peer $NODE_HOSTNAME (${id:0:8}) moved $NODE_IP -> $new: CLUSTER MEET"
            rcli -h "$host" -p "$REDIS_PORT" cluster meet "$new" "$NODE_PORT" "$NODE_CPORT" >/dev/null 2>&1 || true
        done < <(printf '%s\n' "$nodes" | tr -d '\r')
    done
}

mkdir -p "$REDIS_DATA_DIR"
refresh_nodes_conf

read -r -a bind_addrs <<<"$REDIS_BIND"
read -r -a extra_args <<<"$REDIS_EXTRA_ARGS"
args=(
    --port "$REDIS_PORT"
    --bind "${bind_addrs[@]}"
    # with a password set this changes nothing; without one, only loopback clients would get in
    --protected-mode yes
    --dir "$REDIS_DATA_DIR"
    --cluster-enabled yes
    --cluster-config-file "$NODES_CONF"
    --cluster-node-timeout "$REDIS_CLUSTER_NODE_TIMEOUT"
    --cluster-announce-hostname "$REDIS_ANNOUNCE_HOSTNAME"
    --cluster-preferred-endpoint-type hostname
    --appendonly yes
    --appendfsync "$REDIS_APPENDFSYNC"
    --save ''
    --maxmemory "$REDIS_MAXMEMORY"
    --maxmemory-policy "$REDIS_MAXMEMORY_POLICY"
)
[[ -n $REDIS_ANNOUNCE_IP ]] && args+=(--cluster-announce-ip "$REDIS_ANNOUNCE_IP")
args+=("${extra_args[@]}")

# The loop is started before exec, so after exec it is a child of redis-server (same pid as this
# shell), which stays pid 1 of the container and gets SIGTERM directly.
rejoin_loop "$$" &
log "starting redis-server as $REDIS_ANNOUNCE_HOSTNAME ${REDIS_ANNOUNCE_IP:+($REDIS_ANNOUNCE_IP) }on port $REDIS_PORT"
# `-` as the last argument: read more configuration from standard input, here the password
exec "$REDIS_SERVER" "${args[@]}" - <<EOF
requirepass $REDIS_PASSWORD
masterauth $REDIS_PASSWORD
EOF
