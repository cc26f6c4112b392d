#!/bin/bash
# Bench suites on the device machine (one call; from the repo root, with ".whl" carried for the
# GPU extras: liger-kernel, cut-cross-entropy, bitsandbytes, nvidia-cudnn-frontend; the carry is
# at most 64 MiB with the tree, so bitsandbytes' 43 MB wheel goes in only for optim-8bit):
#
#   bash bench/device.sh SUITE ["SUITE ARGS ..."] ...
#   bash bench/device.sh optim-step "optim-8bit --iters 10" "sft-step --shapes qwen3-4b --steps 16"
#   TESTS="-m cuda tests/unit/test_losses.py" bash bench/device.sh loss-memory
#   BUDGET=560 bash bench/device.sh "distill --steps 8 --budget 520"
#       (suites that run TRL, distill and preference, need its wheels in .whl too: cp /work/trlwhl/*.whl .whl/;
#       without them their TRL setups fail with one line and the pgs setups still run; keep the suite's
#       --budget under BUDGET, which also covers installing the wheels)
#
# Each argument is one run: a suite name (`python -m bench --list`), then its arguments.  The
# runs go one after another, each under a timeout of what is left of BUDGET seconds (default
# 580; a run is skipped when less than 20 s are left); each writes $OUT/<date>-<suite>.json
# (-2, -3, ... for a suite named twice), and their output goes to $OUT/all.log.  TESTS: pytest
# arguments run first within TEST_S seconds (default 150), failure lines and summary in
# $OUT/pytest.log.  At the end it prints the pytest lines, each JSON's headline rows
# (bench/summarize.py) and the tail of the log.
source "$(dirname "$0")/device_env.sh"
BUDGET=${BUDGET:-580}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/all.log" 2>&1
if [ -n "${TESTS:-}" ]; then
  log pytest $TESTS
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  cuda_tests "${TEST_S:-150}" --tb=line $TESTS
fi
for run in "$@"; do
  if [ "$(left "$BUDGET")" -lt 20 ]; then
    log "skipped (budget spent): $run"
    continue
  fi
  log "$run"
  # shellcheck disable=SC2086  # a run is a suite name and its arguments, split on spaces
  timeout "$(left "$BUDGET")" python3 -m bench --results "$OUT" $run >> "$OUT/all.log" 2>&1
  rc=$?
  [ "$rc" != 0 ] && log "exit $rc: $run"
done
log done
[ -f "$OUT/pytest.log" ] && cat "$OUT/pytest.log"
shopt -s nullglob
python3 bench/summarize.py "$OUT"/*.json | cut -c1-300
log_tail 12
