#!/usr/bin/env bash
# Start a Ray node the way nemo_gen fleets need it. The raylet reads
# RAY_process_group_cleanup_enabled once, at its own start: a driver that attaches later
# (ray.address) cannot set it, so it is exported here, before `ray start`. An operator's
# explicit value (0 keeps a dead engine's processes for debugging) wins.
#
#   deployments/ray/start-node.sh --head --port=6379 --num-cpus=2      # head node
#   deployments/ray/start-node.sh --address=HEAD_IP:6379               # every other node
#
# Ray >= 2.59 turns on token auth for clusters it starts: drivers attaching by address need
# RAY_AUTH_MODE=token (nemo_gen sets it when ray.address is configured).
set -euo pipefail
export RAY_process_group_cleanup_enabled="${RAY_process_group_cleanup_enabled:-1}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# The dashboard (an HTTP endpoint) stays off unless asked for; only a head may be told so.
extra=()
for arg in "$@"; do
  if [[ "$arg" == "--head" ]]; then extra=(--include-dashboard=false); fi
done
exec ray start "${extra[@]}" --disable-usage-stats "$@"
