#!/bin/bash
# Before and after on the device machine, back to back in one call: each run (a suite and its
# arguments, as for bench/device.sh) first in the older tree at BASE, then in this tree, so both
# figures come from the same card minutes apart.  BASE is a folder holding an older pgs (made
# here before the call and carried with the tree, e.g.
#   mkdir base && git archive <commit> pgs bench specs pyproject.toml | tar -x -C base
# then remove it after the call).  From the repository root, ".whl" carried as for device.sh:
#
#   BASE=base BUDGET=560 bash bench/device_compare.sh "product --spec specs/qwen3_0.6b_packed.toml --order pgs"
#
# Results: $OUT/base/<date>-<suite>.json and $OUT/head/<date>-<suite>.json, the output of both in
# $OUT/all.log; at the end each side's headline rows (bench/summarize.py).  A run is skipped when
# less than 20 s of BUDGET (default 580) are left.
source "$(dirname "$0")/device_env.sh"
BUDGET=${BUDGET:-580}
: "${BASE:?BASE: the folder of the older tree}"
HEAD=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/all.log" 2>&1
mkdir -p "$OUT/base" "$OUT/head"
for run in "$@"; do
  for side in base head; do
    if [ "$(left "$BUDGET")" -lt 20 ]; then
      log "skipped (budget spent): $side $run"
      continue
    fi
    tree=$HEAD
    [ "$side" = base ] && tree=$(cd "$BASE" && pwd)
    log "$side: $run"
    # shellcheck disable=SC2086  # a run is a suite name and its arguments, split on spaces
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$(left "$BUDGET")" python3 -m bench --results "$OUT/$side" $run) \
      >> "$OUT/all.log" 2>&1
    rc=$?
    [ "$rc" != 0 ] && log "exit $rc: $side $run"
  done
done
log done
shopt -s nullglob
for side in base head; do
  echo "== $side"
  python3 bench/summarize.py "$OUT/$side"/*.json | cut -c1-300
done
log_tail 12
