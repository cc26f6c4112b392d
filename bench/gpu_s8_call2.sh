#!/bin/bash
# Session 8, call 2 (one H200; carry ".whl"): the convergence check on text through a real
# tokenizer. bench/sft_converge.py --data bpe: the stdlib's sources through a byte-level BPE
# trained on them (tens of thousands of ids used, a Zipf-like spread, the rest of Qwen3's 151,936
# unseen: what SFT text through the model's tokenizer looks like). 300 steps of 8x1024 tokens at
# the Qwen3-0.6B shape: HF AdamW, pgs lion8bit (bf16 + SR, gradient release), bitsandbytes'
# Lion8bit on HF's fp32 master, pgs adamw8bit (bf16 + SR); then Lion at a smaller lr and with
# the head untied.
source "$(dirname "$0")/device_env.sh"
log converge bpe
timeout "$(left 400)" python3 bench/sft_converge.py --data bpe --steps 300 --lion-lr 1e-4 \
  --only hf_adamw,pgs_lion8bit,hf_lion8bit_bnb,pgs_adamw8bit --out "$OUT/converge_bpe.json" >> "$OUT/all.log" 2>&1
log converge bpe lion 3e-5
timeout "$(left 490)" python3 bench/sft_converge.py --data bpe --steps 300 --lion-lr 3e-5 --only pgs_lion8bit \
  --out "$OUT/converge_bpe_lion3e-5.json" >> "$OUT/all.log" 2>&1
log converge bpe untied
timeout "$(left 580)" python3 bench/sft_converge.py --data bpe --steps 300 --lion-lr 1e-4 --untie \
  --only pgs_lion8bit,hf_adamw --out "$OUT/converge_bpe_untied.json" >> "$OUT/all.log" 2>&1
log done
log_tail 14
