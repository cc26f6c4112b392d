#!/bin/bash
# Fourth device call of session 3 (one H200; carry ".whl"): the Qwen3-0.6B 8x4096 packed table
# from one call, each variant in its own process: HF's setups with SDPA (the issue's
# baselines), HF + Liger given the same varlen attention, pgs with varlen attention.
source "$(dirname "$0")/device_env.sh"
log sft 0.6b
timeout 330 python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 --out "$OUT/sft_06b.json" \
  --only hf_liger,hf_compiled,hf_liger_varlen,pgs_release_noac_varlen,pgs_release_varlen,pgs_release_noac >> "$OUT/all.log" 2>&1
log done
log_tail 20
