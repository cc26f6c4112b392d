#!/bin/bash
# Session 8, call 4 (one H200; carry ".whl"): the convergence check as fine-tuning. From scratch
# (calls 2-3) Lion trailed AdamW by 1.1+ nats at every lr on the BPE text, bitsandbytes' Lion
# with it. Here every variant starts from the same trained weights: 200 steps of HF AdamW on the
# first 45% of the BPE text (sft_converge.py --warm-start), then 200 steps of each variant on the
# next 50% (8x1024 tokens, the Qwen3-0.6B shape); then pgs lion8bit at a fine-tuning lr (3e-5);
# then the same on the Markov chain (warm start on another chain) while time lasts.
source "$(dirname "$0")/device_env.sh"
log finetune bpe
timeout "$(left 330)" python3 bench/sft_converge.py --data bpe --warm-start 200 --steps 200 --lion-lr 1e-4 \
  --only hf_adamw,pgs_lion8bit,hf_lion8bit_bnb,pgs_adamw8bit --out "$OUT/finetune_bpe.json" >> "$OUT/all.log" 2>&1
log finetune bpe lion 3e-5
timeout "$(left 450)" python3 bench/sft_converge.py --data bpe --warm-start 200 --steps 200 --lion-lr 3e-5 \
  --only pgs_lion8bit --out "$OUT/finetune_bpe_lion3e-5.json" >> "$OUT/all.log" 2>&1
log finetune markov
timeout "$(left 585)" python3 bench/sft_converge.py --states 256 --warm-start 150 --steps 200 --lion-lr 1e-4 \
  --only pgs_lion8bit,hf_adamw --out "$OUT/finetune_markov.json" >> "$OUT/all.log" 2>&1
log done
log_tail 14
