#!/bin/bash
# The last device call of session 2: the GPU-only tests fixed since the previous call, issue 8's
# probe + same-run HF baselines (bench/experiments/sft_probe.sh), the 8-bit diagnostic, and Muon's
# "auto" kernel choice.  Carry ".whl".  Logs are appended to $OUT/all.log (8 files come back).
source "$(dirname "$0")/device_env.sh"
log pytest
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_interpret.py tests/test_release_fused.py \
  tests/test_fused_kernels.py tests/test_deferred_kernels.py -x 2>&1 | tail -15 >> "$OUT/all.log"
log probe.sh
bash bench/experiments/sft_probe.sh > /dev/null 2>&1
log diag 8bit
timeout "$(left 390)" python3 bench/experiments/gpu_diag_8bit.py 2>&1 | grep -v -i "warn" | tail -60 >> "$OUT/all.log"
log muon auto
timeout "$(left 440)" python3 bench/muon_bench.py "$OUT/muon_auto.json" --configs none --iters 5 --dtype bfloat16 2>&1 \
  | grep -v -i warn | head -30 >> "$OUT/all.log"
log done
grep -v -i "USDT\|warn\|^ *$\|  File \|dynamo" "$OUT/all.log" | cut -c1-200 | tail -150
