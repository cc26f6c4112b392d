#!/bin/bash
# Session 7, call 4 (one H200; carry ".whl"), the session's last. (1) the CUDA tests of the
# attention file (s7_call3's pytest was cut off by its timeout before a summary); (2) Qwen3-0.6B
# packed with the cuDNN bucket at 16 documents (s7_call3 had 64: padding 36 documents to 64 cost
# 0.66 ms per layer) against HF + Liger unisolated; (3) the convergence check run past the
# plateau: 500 steps of the 256-state chain, pgs lion8bit (release, bf16 + SR, lr 1e-4) and HF
# AdamW (s6_call7/s7_call2: at 200 steps AdamW was just leaving the unigram plateau).
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 100 -n 4 --tb=short tests/test_attention_varlen.py
log sft 06b
timeout "$(left 240)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen,hf_liger_causal >> "$OUT/all.log" 2>&1
log converge
timeout "$(left 585)" python3 bench/sft_converge.py --steps 500 --states 256 --lion-lr 1e-4 --only pgs_lion8bit,hf_adamw \
  --out "$OUT/converge_500.json" >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 8
