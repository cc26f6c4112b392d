#!/bin/bash
# Session 7, call 5 (one H200; carry ".whl"; the last 310 s of device time). (1) Is Lion's
# plateau at the 0.6B shape (s7_call4: pgs lion8bit at 5.353 after 500 steps, HF AdamW at the
# chain's entropy) Lion's or pgs's? bitsandbytes' Lion8bit on HF's fp32 master at the same lr,
# 300 steps; (2) the final code's 0.6B packed step (cuDNN bucket back at 64 after s7_call4's 16).
source "$(dirname "$0")/device_env.sh"
log converge
timeout 140 python3 bench/sft_converge.py --steps 300 --states 256 --lion-lr 1e-4 --only hf_lion8bit_bnb \
  --out "$OUT/converge_bnb.json" >> "$OUT/all.log" 2>&1
log sft 06b
timeout "$(left 245)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen >> "$OUT/all.log" 2>&1
log done
log_tail 8
