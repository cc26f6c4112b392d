#!/bin/bash
# Sixth device call of session 5 (one H200; carry ".whl"): the chain passes launched through
# kernels._launch (CUDA tests, then isolated and back-to-back timing), the checkpointing tests
# on CUDA, and Qwen3-4B <= 12 GiB against HF a third time with the committed code.
# (Its pytest ran past the 100 s timeout with no summary; the chain's _launch change was then
# taken back, so this script now times the chain as committed.)
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 100 --tb=line tests/test_chain8bit.py tests/test_checkpointing.py tests/test_kernels_interpret.py
log optim chain
timeout 110 python3 bench/optim_8bit.py "$OUT/optim_chain.json" --budget 90 --trace "" \
  --isolate pgs_chain_fused --only pgs_lion8bit,pgs_chain_fused > "$OUT/optim_chain.log" 2>&1
log sft 4b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 6
python3 bench/summarize.py "$OUT/optim_chain.json" "$OUT/sft_4b.json"
