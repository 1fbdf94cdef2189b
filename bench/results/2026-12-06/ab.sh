#!/bin/bash
# One benchmark, the script as it was before bench/ became one tool (41bd72d, run by path from a copy
# of that bench/) against `python -m bench NAME`, alternated old/new/... with the same flags, each
# under the engine lock and capped at 8 minutes: what the tool itself changes, apart from the
# machine's drift. From the repository root (the checkout's nemo_gen serves both arms).
#   bash bench/results/2026-12-06/ab.sh NAME "FLAGS" old new [new old ...]
set -u
here=$(dirname "$0"); name=$1; flags=$2; shift 2
old=/tmp/bench-41bd72d
if [ ! -d $old ]; then mkdir -p $old && git archive 41bd72d bench | tar -x -C $old --strip-components=1; fi
n=0
for arm in "$@"; do
  n=$((n + 1))
  if [ "$arm" = old ]; then cmd=(.venv/bin/python "$old/$name.py"); else cmd=(.venv/bin/python -m bench "$name"); fi
  flock /tmp/nemo_gen_engine.lock timeout 480 env PYTHONPATH="$PWD" "${cmd[@]}" $flags \
    --json "$here/ab-$name-$n-$arm.json" > "$here/ab-$name-$n-$arm.log" 2>&1
  rc=$?
  echo "$(date -u +%H:%M:%S) $name $n $arm rc=$rc"
  if [ "$arm" = old ] && [ -f "$here/ab-$name-$n-old.json" ]; then  # the old script's JSON, in the schema
    PYTHONPATH="$PWD" .venv/bin/python -c '
import json, sys
from bench.lib.result import make, validate
path, name, flags = sys.argv[1:]
old = json.load(open(path))
doc = make(name, {"flags": flags, "script": "41bd72d:bench/" + name + ".py"}, old if isinstance(old, dict) else {"runs": old})
doc["commit"] = "41bd72d (bench/ as it was; nemo_gen of this checkout)"
validate(doc)
open(path, "w").write(json.dumps(doc, indent=1) + "\n")' "$here/ab-$name-$n-old.json" "$name" "$flags"
  fi
done
