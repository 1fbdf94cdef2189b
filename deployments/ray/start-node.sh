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
# RAY_AUTH_MODE=token (nemo_gen sets it when ray.address is configured). `ray start --head`
# does not make a token the way `ray.init()` does for a local cluster: on a machine that never
# ran Ray it exits with "Token authentication is enabled but no authentication token was found".
# So a head makes one (~/.ray/auth_token) when none is given; every other node and every driver
# needs that same token (the same file on the same host; RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH
# elsewhere).
set -euo pipefail
export RAY_process_group_cleanup_enabled="${RAY_process_group_cleanup_enabled:-1}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# The dashboard (an HTTP endpoint) stays off unless asked for; only a head may be told so.
extra=()
head=0
for arg in "$@"; do
  if [[ "$arg" == "--head" ]]; then extra=(--include-dashboard=false); head=1; fi
done
if [[ $head == 1 && "${RAY_AUTH_MODE,,}" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" \
      && ! -s "$HOME/.ray/auth_token" ]]; then
  ray get-auth-token --generate >/dev/null
fi
exec ray start "${extra[@]}" --disable-usage-stats "$@"
