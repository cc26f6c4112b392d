#!/bin/bash
# First device call of session 5 (one H200; carry ".whl"): (1) the CUDA runs of the tests
# changed after session 4's last call (chain tolerance, slab tests on the GPU), (2) Qwen3-4B
# <= 12 GiB with the pinned pool and the sync-free slab step, HF in the same call, (3) the
# chain passes' ROWS_A / LANES variants again.
# (session 5 renamed the chain variants: ROWS_A 16 and 512 lanes are the defaults now; the
# session-4 setting is pgs_chain_fused_a4_lanes64 in bench/optim_8bit.py)
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 150 --tb=line tests/test_chain8bit.py tests/test_release_slabs.py tests/test_release_launches.py tests/test_small_kernel.py
log sft 4b
timeout "$(left 400)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub,pgs_release_slabs_sub+pool,pgs_release_slabs_sub+sf+pool \
  >> "$OUT/all.log" 2>&1
log optim chain
timeout "$(left 540)" python3 bench/optim_8bit.py "$OUT/optim_chain.json" --budget "$(left 500)" --trace "" \
  --isolate pgs_chain_fused,pgs_chain_fused_a16,pgs_chain_fused_lanes512,pgs_chain_fused_a16_lanes512 \
  --only pgs_lion8bit,pgs_chain_fused,pgs_chain_fused_a16,pgs_chain_fused_lanes512,pgs_chain_fused_a16_lanes512 \
  > "$OUT/optim_chain.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 8
python3 bench/summarize.py "$OUT/optim_chain.json" "$OUT/sft_4b.json"
