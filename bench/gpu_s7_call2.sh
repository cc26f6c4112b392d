#!/bin/bash
# Session 7, call 2 (one H200; carry ".whl"). s7_call1: cuDNN THD (nvidia-cudnn-frontend 1.32)
# was 2.11 ms fwd+bwd per 0.6B layer against FA2's 3.24, yet the 0.6B step gained nothing
# (105.6k vs 105.4k tok/s): every step's new document count built a new graph. (1) the probe:
# determinism, padding to 64-document buckets, first calls in a bucket; (2) 0.6B with the
# bucketed op, profiled; (3) convergence: Lion at lr 3e-4 and 1e-3, AdamW 8-bit (same optimizer
# as HF's baseline), 200 steps of the 256-state chain.
source "$(dirname "$0")/device_env.sh"
log attn probe
timeout 120 python3 bench/experiments/attn_cudnn.py --frontend-pad "$OUT/attn_pad.json" > "$OUT/attn.log" 2>&1
log sft 06b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --profile 2 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen+cudnnthd,hf_liger_causal,pgs_release_noac_varlen,hf_liger_varlen+cudnnthd \
  >> "$OUT/all.log" 2>&1
log converge
timeout "$(left 440)" python3 bench/sft_converge.py --steps 200 --states 256 --lion-lr 3e-4 --only pgs_lion8bit,pgs_adamw8bit \
  --out "$OUT/converge_a.json" >> "$OUT/all.log" 2>&1
timeout "$(left 570)" python3 bench/sft_converge.py --steps 200 --states 256 --lion-lr 1e-3 --only pgs_lion8bit \
  --out "$OUT/converge_b.json" >> "$OUT/all.log" 2>&1
log done
grep "^{" "$OUT/attn.log" | cut -c1-700
log_tail 12
