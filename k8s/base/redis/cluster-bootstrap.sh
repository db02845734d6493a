#!/usr/bin/env bash
# Form the Redis Cluster once: the redis-cluster-bootstrap Job runs this.
#
#   - waits until every listed node answers PING;
#   - if all nodes are empty: it makes N / (REDIS_REPLICAS + 1) masters with REDIS_REPLICAS
#     replicas each, paired by zone (plan_shards in redis-lib.sh: a master and its replicas in
#     different zones, the masters spread over the zones): `redis-cli --cluster create` of the
#     masters, then `--cluster add-node --cluster-slave` of each replica to its master, each once
#     the nodes agree about the slots (`redis-cli --cluster check` passes: add-node refuses
#     otherwise, and a node just met takes a while to learn them); a replica that fails to join
#     all the same is left to finish (below); then it waits until every node reports
#     cluster_state:ok;
#   - if any node already belongs to a cluster (knows other nodes or owns slots) it waits for
#     cluster_state:ok (a restart may still be settling; after REDIS_BOOTSTRAP_TIMEOUT it exits 1
#     with a hint, never repairing the cluster), then finishes what a run killed before its last
#     replica left undone (finish, below): a listed node outside the cluster, or in it as a master
#     without slots, joins as a replica of the master with the fewest, in another zone, each once
#     the nodes agree, and one that fails to join is tried again (until REDIS_BOOTSTRAP_TIMEOUT).
#     It never touches a node of the cluster otherwise, and on a complete cluster it changes nothing.
# So running it again (the Job re-applied, a retried or evicted pod) is always safe, and converges.
#
# Settings (environment):
#   REDIS_NODES              required: host:port of every node, comma- or space-separated
#   REDIS_PASSWORD           the nodes' password (redis-auth Secret)
#   REDIS_REPLICAS           replicas per master (1)
#   REDIS_BOOTSTRAP_TIMEOUT  seconds to wait for the nodes, for them to agree and for
#                            cluster_state:ok, all told (600)
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

# wait_agree IP:PORT: wait until `redis-cli --cluster check IP:PORT` passes: every node the member
# IP:PORT knows sees the same owner for each slot, every slot has one, none is open. `--cluster
# add-node` checks the same first and refuses to add a node while it fails ("Nodes don't agree about
# configuration!"), as it does for a while after any node joins: the node just met learns the
# masters' slots by gossip, one handshake at a time, and the cluster_state:ok of the others says
# nothing of it.
wait_agree() {
    local out said=""
    while :; do
        out=$(rcli --cluster check "$1" 2>&1 </dev/null) && return 0
        out=$(awk '{ gsub(/\033\[[0-9;]*m|\r/, "") }
            sub(/^.*\[ERR\] */, "") { printf "%s%s", sep, $0; sep = "; " }' <<<"$out")
        ((SECONDS < deadline)) || {
            log "the nodes do not agree: redis-cli --cluster check $1 says: ${out:-?}"
            return 1
        }
        if [[ -z $said ]]; then
            log "waiting for the nodes to agree (redis-cli --cluster check $1 says: ${out:-?})"
            said=1
        fi
        sleep "$REDIS_POLL_INTERVAL"
    done
}

# zone_of HOST: HOST's zone in REDIS_ZONES_FILE, by its full name or its first label ("" if none)
zone_of() {
    [[ -n ${REDIS_ZONES_FILE:-} ]] || return 0
    awk -v host="$1" -v pod="${1%%.*}" '$1 == host || $1 == pod { print $2; exit }' "$REDIS_ZONES_FILE"
}

# read_view IP PORT: the cluster as the member IP:PORT sees it (CLUSTER NODES), into the globals
# view_ids (every node but those in a handshake) and, by node id, view_addr (ip:port), view_host
# (the host name it announces), view_flags, view_master (its master's id, `-` for a master) and
# view_slots (its slot ranges, "" for none).
declare -a view_ids
declare -A view_addr view_host view_flags view_master view_slots
read_view() {
    local id addr flags master slots
    view_ids=()
    view_addr=() view_host=() view_flags=() view_master=() view_slots=()
    while read -r id addr flags master _ _ _ _ slots; do
        [[ -n ${id:-} && -n ${flags:-} && ,$flags, != *,handshake,* ]] || continue
        split_node_address "$addr"
        view_ids+=("$id")
        view_addr[$id]="$NODE_IP:$NODE_PORT"
        view_host[$id]=$NODE_HOSTNAME
        view_flags[$id]=$flags
        view_master[$id]=$master
        view_slots[$id]=${slots:-}
    done < <(rcli -h "$1" -p "$2" cluster nodes 2>/dev/null | tr -d '\r')
}

# listed_id NODE: the id under which the cluster (read_view) knows NODE, a REDIS_NODES entry
# (host:port): the node announcing that host name or its pod name (the first label), else the one
# at the address the name resolves to now; nothing when NODE is not in the cluster. By name first:
# a member whose pod is down or has a new IP is still known by its name.
listed_id() {
    local host=${1%:*} port=${1##*:} id ip
    for id in "${view_ids[@]}"; do
        [[ -n ${view_host[$id]} && ${view_addr[$id]##*:} == "$port" ]] || continue
        if [[ ${view_host[$id]} == "$host" ||
            (! $host =~ ^[0-9.]+$ && ${view_host[$id]%%.*} == "${host%%.*}") ]]; then
            printf '%s\n' "$id"
            return 0
        fi
    done
    ip=$(resolve "$host")
    [[ -n $ip ]] || return 0
    for id in "${view_ids[@]}"; do
        if [[ ${view_addr[$id]} == "$ip:$port" ]]; then
            printf '%s\n' "$id"
            return 0
        fi
    done
}

# has_flag ID FLAG: the node ID carries FLAG in the view
has_flag() {
    [[ ,${view_flags[$1]}, == *,"$2",* ]]
}

# attach_input: plan_attach's input, from finish's view and its locals (todo, id_of, name_of,
# planned_master): each master that owns slots with its replica count and zone, then each node to add.
attach_input() {
    local id other count zone name planned_id
    for id in "${view_ids[@]}"; do
        has_flag "$id" master && [[ -n ${view_slots[$id]} ]] || continue
        count=0
        for other in "${view_ids[@]}"; do
            [[ ${view_master[$other]} == "$id" ]] && count=$((count + 1))
        done
        zone=""
        [[ -n ${name_of[$id]:-} ]] && zone=$(zone_of "${name_of[$id]%:*}")
        printf 'master %s %d %s\n' "$id" "$count" "$zone"
    done
    for name in "${todo[@]}"; do
        planned_id=${id_of[${planned_master[$name]:-none}]:-}
        [[ -n $planned_id && -n ${view_slots[$planned_id]} ]] || planned_id=-
        printf 'missing %s %s %s\n' "$name" "$planned_id" "$(zone_of "${name%:*}")"
    done
}

# finish SEED: the cluster exists (SEED, ip:port, is a member). Wait for cluster_state:ok, then
# add the listed nodes it lacks as replicas: a node outside it, or in it as a master without
# slots, is what a bootstrap leaves that died after `--cluster create` and before its last
# `--cluster add-node --cluster-slave` (or in the middle of one: joined, not yet a replica). Each
# goes to the master plan_attach picks (fewest replicas, another zone, the one plan_shards
# planned). Only while the masters that own slots are as many as the bootstrap makes from
# REDIS_NODES: otherwise the listed nodes are meant to become masters, which is slot moving and
# is done by hand (k8s/README.md, "Scale Redis"), and they are left alone. A complete cluster is
# not touched. Before each node it waits for the nodes to agree (wait_agree); a node that fails to
# join all the same (the nodes disagreed again, a node met later) is tried again from a fresh view
# until the deadline: one left met but not a replica is then in the cluster without slots.
finish() {
    local seed=$1 name id pending reason ip info known assigned shards want m_id m_name list failed
    local -a todo added=()
    local -A id_of name_of addr_of planned_master
    wait_ok "$seed" ||
        die "the cluster exists but is not ok; inspect it with: redis-cli --cluster check $seed" \
            "(and redis-cli --cluster fix $seed if slots are open or uncovered)"
    want=$((${#nodes[@]} / (REDIS_REPLICAS + 1)))
    # whose replica plan_shards would have made each listed node, by name
    while read -r _ name m_name; do
        planned_master[$name]=$m_name
    done < <(for name in "${nodes[@]}"; do
        printf '%s %s\n' "$name" "$(zone_of "${name%:*}")"
    done | plan_shards "$REDIS_REPLICAS" 2>/dev/null | awk '$1 == "replica"')
    while :; do
        while :; do
            read_view "${seed%:*}" "${seed##*:}"
            id_of=() name_of=() todo=()
            for name in "${nodes[@]}"; do
                id=$(listed_id "$name")
                if [[ -z $id ]]; then
                    todo+=("$name")
                    continue
                fi
                id_of[$name]=$id
                name_of[$id]=$name
                # (a failing master without slots is left to come back: it may be a failed-over one)
                if has_flag "$id" master && [[ -z ${view_slots[$id]} ]] &&
                    ! has_flag "$id" fail && ! has_flag "$id" 'fail?'; then
                    todo+=("$name")
                fi
            done
            if ((${#todo[@]} == 0)); then
                ((${#added[@]} == 0)) || break 2
                log "every listed node is in the cluster; nothing to do"
                return 0
            fi
            shards=0
            for id in "${view_ids[@]}"; do
                if has_flag "$id" master && [[ -n ${view_slots[$id]} ]]; then
                    shards=$((shards + 1))
                fi
            done
            if ((shards != want)); then
                printf -v list ' %s' "${todo[@]}"
                log "not in the cluster, or in it without slots:$list; left alone: REDIS_NODES" \
                    "and REDIS_REPLICAS=$REDIS_REPLICAS make $want masters and $shards own slots (masters" \
                    "are added by hand: k8s/README.md, \"Scale Redis\")"
                return 0
            fi
            # every node to add must answer, and one outside the cluster must be in no cluster
            pending=""
            for name in "${todo[@]}"; do
                ip=$(resolve "${name%:*}")
                reason=""
                if [[ -z $ip || $(rcli -h "$ip" -p "${name##*:}" ping 2>/dev/null | tr -d '\r') != PONG ]]; then
                    reason="no answer"
                elif [[ -z ${id_of[$name]:-} ]]; then
                    info=$(cluster_info "$ip" "${name##*:}")
                    known=$(info_field "$info" cluster_known_nodes)
                    assigned=$(info_field "$info" cluster_slots_assigned)
                    if ((${known:-1} > 1 || ${assigned:-0} > 0)); then
                        reason="knows other nodes or owns slots, but is not in this cluster"
                    fi
                fi
                if [[ -n $reason ]]; then
                    pending+=" $name ($reason)"
                else
                    addr_of[$name]="$ip:${name##*:}"
                fi
            done
            [[ -z $pending ]] && break
            ((SECONDS < deadline)) || die "cannot add to the cluster:$pending"
            log "waiting for:$pending"
            sleep "$REDIS_POLL_INTERVAL"
        done

        log "the cluster lacks ${#todo[@]} replica(s) of the $want masters; adding them"
        failed=""
        while read -r _ name m_id; do
            wait_agree "${view_addr[$m_id]}" ||
                die "the nodes do not agree about the cluster; inspect it with:" \
                    "redis-cli --cluster check ${view_addr[$m_id]}"
            if [[ -n ${id_of[$name]:-} ]]; then
                log "  replica $name (zone $(zone_of "${name%:*}")), in the cluster without slots," \
                    "of ${view_addr[$m_id]} (${view_host[$m_id]:-?}, zone $(zone_of "${view_host[$m_id]:-}"))"
                reason=$(rcli -h "${addr_of[$name]%:*}" -p "${name##*:}" cluster replicate "$m_id" \
                    2>&1 </dev/null | tr -d '\r')
                [[ $reason == OK ]] || failed="CLUSTER REPLICATE $m_id on $name: $reason"
            else
                log "  replica $name (zone $(zone_of "${name%:*}")) of ${view_addr[$m_id]}" \
                    "(${view_host[$m_id]:-?}, zone $(zone_of "${view_host[$m_id]:-}"))"
                rcli --cluster add-node "${addr_of[$name]}" "${view_addr[$m_id]}" \
                    --cluster-slave --cluster-master-id "$m_id" </dev/null ||
                    failed="redis-cli --cluster add-node of $name failed (its output above)"
            fi
            [[ -z $failed ]] || break
            added+=("${addr_of[$name]}")
        done < <(attach_input | plan_attach "$REDIS_REPLICAS")
        [[ -n $failed ]] || break
        ((SECONDS < deadline)) || die "$failed"
        log "$failed; reading the cluster again"
        sleep "$REDIS_POLL_INTERVAL"
    done
    wait_ok "$seed" "${added[@]}" || die "replicas added, but cluster_state is not ok in time"
    rcli --cluster check "$seed" >/dev/null || die "redis-cli --cluster check $seed failed"
    log "cluster complete: ${#added[@]} replica(s) added, cluster_state:ok"
}

# 1. Wait for every node; if any of them is already part of a cluster, finish that one instead.
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
            log "already formed: $node knows $known nodes and $assigned slots are assigned"
            finish "$ip:$port"
            exit 0
        fi
    done
    [[ -z $waiting ]] && break
    ((SECONDS < deadline)) || die "no answer within ${REDIS_BOOTSTRAP_TIMEOUT}s from:$waiting"
    log "waiting for:$waiting"
    sleep "$REDIS_POLL_INTERVAL"
done

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
# (each add-node changes what the next one checks: wait_agree before each; a node that fails to
# join all the same is left to finish, which tries it again as the next run would)
while read -r kind address master; do
    [[ $kind == replica ]] || continue
    id=$(rcli -h "${master%:*}" -p "${master##*:}" cluster myid </dev/null | tr -d '\r')
    [[ -n $id ]] || die "no node id from the master $master"
    wait_agree "$master" ||
        die "the nodes do not agree about the new cluster; inspect it with: redis-cli --cluster check $master"
    log "  replica $address (zone ${zone_at[$address]:-unknown}) of $master (zone ${zone_at[$master]:-unknown})"
    if ! rcli --cluster add-node "$address" "$master" --cluster-slave --cluster-master-id "$id" </dev/null; then
        log "redis-cli --cluster add-node of $address failed (its output above); finishing the cluster"
        finish "${masters[0]}"
        exit 0
    fi
done <<<"$plan"

# 3. Wait until every node agrees.
wait_ok "${addrs[@]}" || die "the cluster was created but did not reach cluster_state:ok in time"
rcli --cluster check "${addrs[0]}" >/dev/null || die "redis-cli --cluster check ${addrs[0]} failed"
log "cluster formed: cluster_state:ok on all ${#addrs[@]} nodes"
