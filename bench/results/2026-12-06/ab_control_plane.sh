#!/bin/bash
# control_plane, the script as it was (41bd72d, run by path) against `python -m bench control_plane`,
# alternated old/new/new/old at the default sizes on the same machine minutes: what the tool itself
# changes, apart from the machine's drift. Under the engine lock (it is CPU-bound). From the repo root.
set -u
here=$(dirname "$0")
git show 41bd72d:bench/control_plane.py > /tmp/control_plane_41bd72d.py
for arm in old new new old; do
  n=$((${n:-0} + 1))
  if [ $arm = old ]; then cmd=(.venv/bin/python /tmp/control_plane_41bd72d.py); else cmd=(.venv/bin/python -m bench control_plane); fi
  flock /tmp/nemo_gen_engine.lock timeout 480 env PYTHONPATH="$PWD" "${cmd[@]}" --json "$here/ab-control_plane-$n-$arm.json" \
    > "$here/ab-control_plane-$n-$arm.log" 2>&1
  echo "$(date -u +%H:%M:%S) $n $arm rc=$?"
done
