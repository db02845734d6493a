#!/usr/bin/env bash
# Readiness and liveness of one Redis Cluster node (exec probes of the StatefulSet).
#   redis-probe.sh ready   the node answers PING with PONG (not while it is loading its AOF) and,
#                          a replica, has its master's data (master_link_status:up). Readiness is
#                          what the StatefulSet's rolling update and the PodDisruptionBudget wait
#                          for before they take the next pod: a restarted replica answers PING with
#                          its old data while its full sync runs, and taking its master then would
#                          promote it without the writes it missed
#   redis-probe.sh alive   the node answers at all; LOADING / MASTERDOWN count as alive, so a big
#                          AOF being replayed after a restart does not get the pod killed
# Readiness does not wait for cluster_state:ok: the bootstrap Job and the other nodes reach the
# pods through the headless Service, which publishes them before they are ready anyway.
# Settings: REDIS_PORT (6379), REDIS_BIND (its first address is the one asked; * = 127.0.0.1),
# REDIS_PASSWORD (NOAUTH or WRONGPASS is no sign of life: such a node is neither ready nor alive).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=redis-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/redis-lib.sh"

host=$(local_host)
port=${REDIS_PORT:-6379}
reply=$(rcli -h "$host" -p "$port" ping 2>&1 | tr -d '\r') || true
case ${1:-ready} in
    ready)
        [[ $reply == PONG ]] || exit 1
        replication=$(rcli -h "$host" -p "$port" info replication 2>/dev/null | tr -d '\r') || exit 1
        [[ $(info_field "$replication" role) == master ||
            $(info_field "$replication" master_link_status) == up ]]
        ;;
    alive) [[ $reply == PONG || $reply == *LOADING* || $reply == *MASTERDOWN* ]] ;;
    *)
        echo "usage: ${0##*/} ready|alive" >&2
        exit 2
        ;;
esac
