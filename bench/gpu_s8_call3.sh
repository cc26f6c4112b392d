#!/bin/bash
# Session 8, call 3 (one H200; carry ".whl"): Lion's learning rate on the BPE text of call 2
# (1e-4 there trailed AdamW by 1.1 nats after 300 steps, 3e-5 by more): pgs lion8bit at 3e-4 and
# 1e-3, the same 300 steps of 8x1024 tokens at the Qwen3-0.6B shape.
source "$(dirname "$0")/device_env.sh"
for lr in 3e-4 1e-3; do
  log converge bpe lion $lr
  timeout "$(left 280)" python3 bench/sft_converge.py --data bpe --steps 300 --lion-lr $lr --only pgs_lion8bit \
    --out "$OUT/converge_bpe_lion$lr.json" >> "$OUT/all.log" 2>&1
done
log done
log_tail 6
