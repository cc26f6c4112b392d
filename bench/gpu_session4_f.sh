#!/bin/bash
# Last device call of session 4 (one H200; carry ".whl"): why four slab/launch tests failed on
# CUDA in call e (one line per failure), then Qwen3-4B <= 12 GiB against HF after the pinned
# buffer pool of the offload.
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 45 --tb=line tests/test_release_slabs.py tests/test_release_launches.py
log sft 4b
timeout "$(left 175)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 6
python3 bench/summarize.py "$OUT/sft_4b.json"
