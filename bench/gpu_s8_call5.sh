#!/bin/bash
# Session 8, call 5 (one H200; carry ".whl"): Qwen3-4B with the session's final code, HF's best
# (each decoder layer compiled + checkpointing) and pgs <= 12 GiB alternated twice in one call,
# 16 timed steps each (s6_call6's script).
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout "$(left 250)" python3 bench/sft_step.py --shapes qwen3-4b --steps 16 --warmup 3 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub_varlen,hf_compiled_ac,pgs_release_slabs_sub_varlen >> "$OUT/all.log" 2>&1
log done
log_tail 8
