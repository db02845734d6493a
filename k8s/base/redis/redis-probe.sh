#!/usr/bin/env bash
# Readiness and liveness of one Redis Cluster node (exec probes of the StatefulSet).
#   redis-probe.sh ready   the node answers PING with PONG (not while it is loading its AOF)
#   redis-probe.sh alive   the node answers at all; LOADING / MASTERDOWN count as alive, so a big
#                          AOF being replayed after a restart does not get the pod killed
# Readiness does not wait for cluster_state:ok: the bootstrap Job and the other nodes reach the
# pods through the headless Service, which publishes them before they are ready anyway.
# Settings: REDIS_PORT (6379), REDIS_BIND (its first address is the one asked; * = 127.0.0.1),
# REDIS_PASSWORD (NOAUTH or WRONGPASS is no sign of life: such a node is neither ready nor alive).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=redis-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/redis-lib.sh"

reply=$(rcli -h "$(local_host)" -p "${REDIS_PORT:-6379}" ping 2>&1 | tr -d '\r') || true
case ${1:-ready} in
    ready) [[ $reply == PONG ]] ;;
    alive) [[ $reply == PONG || $reply == *LOADING* || $reply == *MASTERDOWN* ]] ;;
    *)
        echo "usage: ${0##*/} ready|alive" >&2
        exit 2
        ;;
esac
