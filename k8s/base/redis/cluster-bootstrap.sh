#!/usr/bin/env bash
# Form the Redis Cluster once: the redis-cluster-bootstrap Job runs this.
#
#   - waits until every listed node answers PING;
#   - if any node already belongs to a cluster (knows other nodes or owns slots) it changes
#     nothing: it waits for cluster_state:ok (a restart may still be settling) and exits 0, or
#     exits 1 after REDIS_BOOTSTRAP_TIMEOUT with a hint, never touching the cluster;
#   - otherwise all nodes are empty: it makes N / (REDIS_REPLICAS + 1) masters with
#     REDIS_REPLICAS replicas each, paired by zone (plan_shards in redis-lib.sh: a master and its
#     replicas in different zones, the masters spread over the zones): `redis-cli --cluster create`
#     of the masters, then `--cluster add-node --cluster-slave` of each replica to its master; then
#     it waits until every node reports cluster_state:ok.
# So running it again (the Job re-applied, a retried pod) is always safe.
#
# Settings (environment):
#   REDIS_NODES              required: host:port of every node, comma- or space-separated
#   REDIS_PASSWORD           the nodes' password (redis-auth Secret)
#   REDIS_REPLICAS           replicas per master (1)
#   REDIS_BOOTSTRAP_TIMEOUT  seconds to wait for the nodes and for cluster_state:ok (600)
#   REDIS_POLL_INTERVAL      seconds between checks (2)
#   REDIS_ZONES_FILE         `NAME ZONE` lines: each node's zone, NAME its host or the host's first
#                            label (the pod name); the Job's init container writes it from the
#                            nodes' machines' topology.kubernetes.io/zone labels (node-zones.py).
#                            Unset, or a node not in it: no zone (redis-cli's pairing, in effect)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=redis-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/redis-lib.sh"

: "${REDIS_NODES:?set REDIS_NODES to host:port of every node}"
REDIS_REPLICAS="${REDIS_REPLICAS:-1}"
REDIS_BOOTSTRAP_TIMEOUT="${REDIS_BOOTSTRAP_TIMEOUT:-600}"
REDIS_POLL_INTERVAL="${REDIS_POLL_INTERVAL:-2}"

read -r -a nodes <<<"${REDIS_NODES//,/ }"
need=$((3 * (REDIS_REPLICAS + 1)))
((${#nodes[@]} >= need)) ||
    die "${#nodes[@]} nodes listed; $REDIS_REPLICAS replica(s) per master needs at least $need (3 masters)"
deadline=$((SECONDS + REDIS_BOOTSTRAP_TIMEOUT))

# cluster_info IP PORT: CLUSTER INFO of one node ("" when it does not answer)
cluster_info() {
    rcli -h "$1" -p "$2" cluster info 2>/dev/null | tr -d '\r' || true
}

# wait_ok IP:PORT...: wait until every given node reports cluster_state:ok
wait_ok() {
    local a info pending
    while :; do
        pending=""
        for a in "$@"; do
            info=$(cluster_info "${a%:*}" "${a##*:}")
            [[ $(info_field "$info" cluster_state) == ok ]] || pending+=" $a"
        done
        [[ -z $pending ]] && return 0
        ((SECONDS < deadline)) || {
            log "cluster_state is not ok on:$pending"
            return 1
        }
        sleep "$REDIS_POLL_INTERVAL"
    done
}

# 1. Wait for every node; stop early if any of them is already part of a cluster.
while :; do
    addrs=()
    waiting=""
    for node in "${nodes[@]}"; do
        host=${node%:*}
        port=${node##*:}
        ip=$(resolve "$host")
        if [[ -z $ip || $(rcli -h "$ip" -p "$port" ping 2>/dev/null | tr -d '\r') != PONG ]]; then
            waiting+=" $node"
            continue
        fi
        addrs+=("$ip:$port")
        info=$(cluster_info "$ip" "$port")
        [[ -n $(info_field "$info" cluster_state) ]] || die "$node is not running in cluster mode"
        known=$(info_field "$info" cluster_known_nodes)
        assigned=$(info_field "$info" cluster_slots_assigned)
        if ((${known:-1} > 1 || ${assigned:-0} > 0)); then
            log "already formed: $node knows $known nodes and $assigned slots are assigned; nothing to do"
            if wait_ok "$ip:$port"; then
                log "cluster_state:ok"
                exit 0
            fi
            die "the cluster exists but is not ok; inspect it with: redis-cli --cluster check $ip:$port" \
                "(and redis-cli --cluster fix $ip:$port if slots are open or uncovered)"
        fi
    done
    [[ -z $waiting ]] && break
    ((SECONDS < deadline)) || die "no answer within ${REDIS_BOOTSTRAP_TIMEOUT}s from:$waiting"
    log "waiting for:$waiting"
    sleep "$REDIS_POLL_INTERVAL"
done

# zone_of HOST: HOST's zone in REDIS_ZONES_FILE, by its full name or its first label ("" if none)
zone_of() {
    [[ -n ${REDIS_ZONES_FILE:-} ]] || return 0
    awk -v host="$1" -v pod="${1%%.*}" '$1 == host || $1 == pod { print $2; exit }' "$REDIS_ZONES_FILE"
}

# 2. Every node answers and none is in a cluster: create it, with the pairs planned by zone (all
# nodes answered, so addrs[i] is nodes[i]'s address).
declare -A zone_at
for i in "${!nodes[@]}"; do
    zone_at[${addrs[$i]}]=$(zone_of "${nodes[$i]%:*}")
done
plan=$(for a in "${addrs[@]}"; do printf '%s %s\n' "$a" "${zone_at[$a]}"; done | plan_shards "$REDIS_REPLICAS")
mapfile -t masters < <(awk '$1 == "master" { print $2 }' <<<"$plan")
log "creating the cluster: ${#addrs[@]} nodes, $REDIS_REPLICAS replica(s) per master: ${addrs[*]}"
for a in "${masters[@]}"; do
    log "  master $a (zone ${zone_at[$a]:-unknown})"
done
rcli --cluster create "${masters[@]}" --cluster-replicas 0 --cluster-yes
while read -r kind address master; do
    [[ $kind == replica ]] || continue
    id=$(rcli -h "${master%:*}" -p "${master##*:}" cluster myid | tr -d '\r')
    [[ -n $id ]] || die "no node id from the master $master"
    log "  replica $address (zone ${zone_at[$address]:-unknown}) of $master (zone ${zone_at[$master]:-unknown})"
    rcli --cluster add-node "$address" "$master" --cluster-slave --cluster-master-id "$id"
done <<<"$plan"

# 3. Wait until every node agrees.
wait_ok "${addrs[@]}" || die "the cluster was created but did not reach cluster_state:ok in time"
rcli --cluster check "${addrs[0]}" >/dev/null || die "redis-cli --cluster check ${addrs[0]} failed"
log "cluster formed: cluster_state:ok on all ${#addrs[@]} nodes"
