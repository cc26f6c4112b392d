#!/bin/bash
# Fourth device call of session 5 (one H200; carry ".whl"): Qwen3-4B after the recompute frees its
# output before the nested backward (GradientEdge) and the heap is frozen after warm-up
# (every variant): HF, pgs <= 12 GiB with and without the sync-free slab step / pinned pool,
# pgs release at 12.7 GiB.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout "$(left 420)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub+sf+pool,pgs_release_slabs_sub,pgs_release,pgs_release_slabs_sub+pool \
  >> "$OUT/all.log" 2>&1
log done
log_tail 8
python3 bench/summarize.py "$OUT/sft_4b.json"
