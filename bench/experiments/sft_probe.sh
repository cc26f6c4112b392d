#!/bin/bash
# Issue 8's probe, one H200 call (~3.5 minutes, cold caches): where pgs_release's SFT step time
# goes (profile, sync census, variants: bench/experiments/sft_probe.py), then the HF baselines of
# the same run (bench/sft_step.py).  From the repo root; carry ".whl" (liger-kernel for hf_liger).
# Everything lands in $OUT (7 files at most: probe.json, probe.log, <=2 traces, hf_4b.json,
# hf_06b.json, all.log).
source "$(dirname "$0")/../device_env.sh"
log() { echo "=== $* ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/all.log"; }  # this script also prints it
log probe
timeout 155 python3 bench/experiments/sft_probe.py --out "$OUT/probe.json" --trace-dir "$OUT" --budget-s 135 \
  > "$OUT/probe.log" 2>&1
grep -v -i "USDT\|Warning\|warnings.warn\|^ *$\|  File " "$OUT/probe.log" | cut -c1-220 | tee -a "$OUT/all.log"
log hf 4b
timeout "$(left 205)" python3 bench/sft_step.py --shapes qwen3-4b --only hf_compiled_ac --steps 3 --warmup 2 \
  --out "$OUT/hf_4b.json" 2>&1 | grep -v -i "warn\|^ *$\|backend impl" | tee -a "$OUT/all.log"
log hf 0.6b
timeout "$(left 238)" python3 bench/sft_step.py --shapes qwen3-0.6b --only hf_liger --steps 3 --warmup 2 \
  --out "$OUT/hf_06b.json" 2>&1 | grep -v -i "warn\|^ *$\|backend impl" | tee -a "$OUT/all.log"
log done
