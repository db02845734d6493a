# shellcheck shell=bash
# Helpers shared by redis-node.sh, cluster-bootstrap.sh and redis-probe.sh (sourced, not run).
#
# Everything is driven by environment variables so the same files run in the pods and, in
# tests/test_k8s_scripts.py, against redis-server processes on loopback addresses:
#   REDIS_CLI         redis-cli binary (default: redis-cli on PATH)
#   REDIS_PASSWORD    the nodes' password (from the redis-auth Secret); every redis-cli call uses it
#   REDIS_HOSTS_FILE  resolve host names from this /etc/hosts-style file instead of DNS (tests only)

REDIS_CLI="${REDIS_CLI:-redis-cli}"
# redis-cli (and `redis-cli --cluster`) read the password from REDISCLI_AUTH: unlike -a it stays
# off the command line, which every user of the machine can read
if [[ -n ${REDIS_PASSWORD:-} ]]; then
    export REDISCLI_AUTH="$REDIS_PASSWORD"
fi

log() {
    printf '%s %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${0##*/}" "$*" >&2
}

die() {
    log "ERROR: $*"
    exit 1
}

rcli() {
    "$REDIS_CLI" "$@"
}

# resolve NAME: print the address NAME resolves to now (nothing when it does not resolve).
# An IP address resolves to itself. In the pods the headless Service publishes every pod's name,
# even before it is ready (publishNotReadyAddresses), so a restarted pod's new IP shows up at once.
resolve() {
    local name=$1
    if [[ $name =~ ^[0-9]+(\.[0-9]+){3}$ || $name == *:* ]]; then
        printf '%s\n' "$name"
    elif [[ -n ${REDIS_HOSTS_FILE:-} ]]; then
        awk -v h="$name" '$1 !~ /^#/ { for (i = 2; i <= NF; i++) if ($i == h) { print $1; exit } }' \
            "$REDIS_HOSTS_FILE" 2>/dev/null || true
    else
        getent hosts "$name" 2>/dev/null | awk 'NR == 1 { print $1 }' || true
    fi
}

# info_field TEXT NAME: the value of NAME in the output of INFO / CLUSTER INFO.
info_field() {
    printf '%s\n' "$1" | tr -d '\r' | awk -F: -v k="$2" '$1 == k { print $2; exit }'
}

# shellcheck disable=SC2034  # the NODE_* globals are this function's output, used by the callers
# split_node_address FIELD: split the address field of a CLUSTER NODES / nodes.conf line,
# `ip:port@cport[,hostname][,aux=value...]` (IPv6 addresses keep their colons), into the globals
#   NODE_IP NODE_PORT NODE_CPORT NODE_HOSTNAME NODE_ADDR_SUFFIX (everything after `ip:port@cport`).
split_node_address() {
    local field=$1 addr ports
    addr=${field%%,*}
    NODE_ADDR_SUFFIX=${field:${#addr}}
    NODE_HOSTNAME=${NODE_ADDR_SUFFIX#,}
    NODE_HOSTNAME=${NODE_HOSTNAME%%,*}
    [[ $NODE_HOSTNAME == *=* ]] && NODE_HOSTNAME=""
    NODE_IP=${addr%:*}
    ports=${addr##*:}
    NODE_PORT=${ports%@*}
    NODE_CPORT=${ports#*@}
}

# local_host: the address this node's own redis-cli calls use (the first bind address).
local_host() {
    local first
    read -r first _ <<<"${REDIS_BIND:-0.0.0.0}"
    case $first in
        '' | '*' | '-*' | 0.0.0.0) printf '127.0.0.1\n' ;;
        '::' | '-::*' | '::*') printf '::1\n' ;;
        *) printf '%s\n' "${first#-}" ;;
    esac
}

# plan_shards REPLICAS: which nodes the bootstrap makes masters and whose replica each other node
# becomes, from their zones. stdin: `ADDRESS ZONE` per node (ZONE empty when unknown), in
# REDIS_NODES order; stdout: `master ADDRESS` per master, then `replica ADDRESS MASTER_ADDRESS`;
# stderr: a warning per replica that must share its master's zone where there are several zones.
#
# `redis-cli --cluster create` pairs replicas with masters by IP address only, and every pod has
# its own, so a master and its replica could share a zone (one outage, both copies gone). Here the
# nodes are sorted by zone (a stable sort: REDIS_NODES order within a zone) and the node at
# position p joins shard p mod M (M = N / (REPLICAS + 1) shards): a zone's nodes are consecutive,
# so no shard gets two of one zone unless that zone holds more than M nodes, which no plan could
# avoid. Each shard's master is the member whose zone has the fewest masters so far, spreading the
# masters over the zones. Without zones (all equal or empty) this is nodes 0..M-1 as masters, node
# M + i a replica of node i, as redis-cli made them.
plan_shards() {
    awk -v replicas="$1" '
        {
            n = NR
            addr[n] = $1
            zone[n] = NF > 1 ? $2 "" : ""
            if (!(zone[n] in seen)) zones++
            seen[zone[n]] = 1
        }
        END {
            m = int(n / (replicas + 1))
            for (i = 1; i <= n; i++) order[i] = i
            for (i = 2; i <= n; i++)
                for (j = i; j > 1 && zone[order[j - 1]] "" > zone[order[j]] ""; j--) {
                    t = order[j]; order[j] = order[j - 1]; order[j - 1] = t
                }
            for (p = 0; p < n; p++) member[p % m, ++size[p % m]] = order[p + 1]
            for (s = 0; s < m; s++) {
                best = member[s, 1]
                for (k = 2; k <= size[s]; k++)
                    if (masters[zone[member[s, k]]] + 0 < masters[zone[best]] + 0) best = member[s, k]
                head[s] = best
                masters[zone[best]]++
            }
            for (s = 0; s < m; s++) print "master", addr[head[s]]
            for (s = 0; s < m; s++)
                for (k = 1; k <= size[s]; k++) {
                    r = member[s, k]
                    if (r == head[s]) continue
                    print "replica", addr[r], addr[head[s]]
                    if (zones > 1 && zone[r] == zone[head[s]])
                        printf "warning: %s and its master %s are in the same zone, %s: more of its nodes than masters\n", \
                            addr[r], addr[head[s]], zone[r] > "/dev/stderr"
                }
        }'
}

# plan_attach REPLICAS: the master each node the bootstrap finds missing from a formed cluster
# joins as a replica. stdin: `master ID REPLICA_COUNT ZONE` per master that owns slots, then
# `missing NAME PLANNED_ID ZONE` per node to add, in the order to add them (PLANNED_ID: the master
# plan_shards gave it, `-` if that node is no master now; ZONE may be absent); stdout:
# `replica NAME MASTER_ID` per missing node; stderr: a warning per node put in its master's zone.
#
# Each node goes, in this order of preference, to a master with fewer than REPLICAS replicas, in
# another zone, with the fewest replicas, the planned one, the first listed; the choice counts for
# the next node. When the masters are the plan's and the missing nodes its replicas (a bootstrap
# that died before adding them all), this is the plan itself.
plan_attach() {
    awk -v replicas="$1" '
        $1 == "master" { m = ++masters; id[m] = $2; count[m] = $3 + 0; mzone[m] = NF > 3 ? $4 "" : "" }
        $1 == "missing" { r = ++missing; name[r] = $2; planned[r] = $3; rzone[r] = NF > 3 ? $4 "" : "" }
        END {
            for (r = 1; r <= missing; r++) {
                best = 0
                for (m = 1; m <= masters; m++) {
                    key = sprintf("%d %d %09d %d %09d", count[m] >= replicas, \
                        rzone[r] != "" && rzone[r] == mzone[m], count[m], id[m] != planned[r], m)
                    if (!best || key < bestkey) { best = m; bestkey = key }
                }
                if (!best) exit 1
                count[best]++
                print "replica", name[r], id[best]
                if (rzone[r] != "" && rzone[r] == mzone[best])
                    printf "warning: %s joins a master in its own zone, %s: every master short of replicas is there\n", \
                        name[r], rzone[r] > "/dev/stderr"
            }
        }'
}
