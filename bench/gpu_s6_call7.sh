#!/bin/bash
# Session 6, device call 7 (one H200; carry ".whl"): (1) every test file with CUDA paths, on the
# session's final code, (2) the convergence check again with that code: Qwen3-0.6B shape, pgs
# lion8bit (release, bf16 + stochastic rounding) against HF AdamW (fp32 master) on the same
# Markov-chain data, 200 steps, 256 states (learnable within the run).
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 125 -n 4 --tb=line tests/test_8bit_optim.py tests/test_attention_varlen.py tests/test_chain8bit.py \
  tests/test_checkpoint_offload.py tests/test_fused_kernels.py tests/test_kernels_interpret.py tests/test_losses.py \
  tests/test_muon_fast.py tests/test_profile.py tests/test_release_fused.py tests/test_release_launches.py \
  tests/test_release_prefetch.py tests/test_release_slabs.py tests/test_small_kernel.py tests/test_tiled_mlp.py \
  property_tests/test_chain8bit_props.py
log converge
timeout "$(left 270)" python3 bench/sft_converge.py --steps 200 --states 256 --lion-lr 1e-4 \
  --only pgs_lion8bit,hf_adamw --out "$OUT/converge.json" >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 6
