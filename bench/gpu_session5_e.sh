#!/bin/bash
# Last device call of session 5 (one H200; carry ".whl"): (1) the CUDA runs of the tests this
# session touched (chain with ROWS_A 16 / 512 lanes and the rounding-flip bound, checkpointing's
# recompute, slabs, launches, kernels), (2) Qwen3-4B <= 12 GiB against HF once more, (3) the chain
# passes at the new defaults against session 4's, Lion8bit and bitsandbytes in the same run.
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 200 --tb=line tests/test_chain8bit.py tests/test_checkpointing.py tests/test_release_slabs.py tests/test_release_launches.py tests/test_small_kernel.py tests/test_kernels_interpret.py tests/test_release_prefetch.py tests/test_release_fused.py tests/test_deferred_kernels.py
log sft 4b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log optim chain
timeout "$(left 540)" python3 bench/optim_8bit.py "$OUT/optim_chain.json" --budget "$(left 500)" --trace "" \
  --isolate pgs_chain_fused,pgs_chain_fused_a4_lanes64 \
  --only pgs_lion8bit,pgs_chain_fused,pgs_chain_fused_a4_lanes64,bnb_lion8bit > "$OUT/optim_chain.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 8
python3 bench/summarize.py "$OUT/optim_chain.json" "$OUT/sft_4b.json"
