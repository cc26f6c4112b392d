#!/bin/bash
# Session 6, device call 6 (one H200; carry ".whl"): Qwen3-4B, HF and pgs <= 12 GiB (pgs run's
# default attention: varlen, unpacked rows through dense SDPA) alternated twice in one call, 16
# timed steps each: the spread between runs of the same setup on one machine.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 500 python3 bench/sft_step.py --shapes qwen3-4b --steps 16 --warmup 3 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub_varlen,hf_compiled_ac,pgs_release_slabs_sub_varlen >> "$OUT/all.log" 2>&1
log done
log_tail 8
