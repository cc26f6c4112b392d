#!/bin/bash
# A device call of session 4 (one H200; carry ".whl"): issue #8, Qwen3-4B, HF in the same call,
# host timers per phase; then a profile of the <= 12 GiB variant with the phases annotated.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout "$(left 420)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release,pgs_release_slabs_sub,pgs_release_slabs_pg_sub,pgs_release_slabs_pg \
  >> "$OUT/all.log" 2>&1
log sft 4b profile
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-4b --steps 4 --warmup 2 --profile 2 \
  --out "$OUT/sft_4b_profile.json" --only pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log done
log_tail 30
