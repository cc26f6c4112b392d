#!/bin/bash
# Prepared at the end of session 7 for the next device call (one H200; carry ".whl" with the
# nvidia_cudnn_frontend-1.32.0-cp312 wheel beside the others). Not run yet. (1) CUDA tests of the
# files s7_call3's run did not reach before its timeout, the attention file first; (2) the final
# code's Qwen3-0.6B packed step (pad_documents' minimum of two zero-length documents, changed after
# the last call of session 7) against HF + Liger on causal rows; (3) the convergence check on
# gradual data: 300 steps of windows of the stdlib's sources, one token per byte, HF AdamW
# against pgs lion8bit (the Markov chain's plateau held Lion, bitsandbytes' too, at every lr);
# (4) pgs lion8bit on the chain with the head untied (on the CPU, an untied or small-vocabulary
# model took Lion off the plateau: bench/results/s7_cpu/lion_plateau.txt).
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 150 -n 4 --tb=line tests/test_attention_varlen.py tests/test_release_fused.py tests/test_losses.py \
  tests/test_checkpoint_offload.py tests/test_profile.py
log sft 06b
timeout "$(left 300)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen,hf_liger_causal >> "$OUT/all.log" 2>&1
log converge
timeout "$(left 490)" python3 bench/sft_converge.py --data bytes --steps 300 --lion-lr 1e-4 --only hf_adamw,pgs_lion8bit \
  --out "$OUT/converge_bytes.json" >> "$OUT/all.log" 2>&1
timeout "$(left 585)" python3 bench/sft_converge.py --untie --steps 250 --states 256 --lion-lr 1e-4 --only pgs_lion8bit \
  --out "$OUT/converge_untied.json" >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 8
