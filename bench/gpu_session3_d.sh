#!/bin/bash
# Fourth device call of session 3 (one H200; carry ".whl"): the Qwen3-0.6B 8x4096 packed table
# from one call, each variant in its own process: HF's setups with SDPA (the issue's
# baselines), HF + Liger given the same varlen attention, pgs with varlen attention.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "=== $* ($(( $(date +%s) - T0 )) s)" >> "$OUT/all.log"; }
log sft 0.6b
timeout 330 python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 --out "$OUT/sft_06b.json" \
  --only hf_liger,hf_compiled,hf_liger_varlen,pgs_release_noac_varlen,pgs_release_varlen,pgs_release_noac >> "$OUT/all.log" 2>&1
log done
grep -v -i "warn\|^ *$\|This call\|  File \|dynamo\|USDT\|^W1129" "$OUT/all.log" | cut -c1-200 | tail -20
