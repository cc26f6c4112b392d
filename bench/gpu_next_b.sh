#!/bin/bash
# Prepared at the end of session 6 (one H200; carry ".whl"), not run yet: (1) the convergence
# check with the same optimizer on both sides (pgs adamw8bit: release, 8-bit state, bf16 +
# stochastic rounding; against HF AdamW) and Lion at lr 3e-4, 200 steps of the 256-state chain
# (s6_call7 had lion8bit at lr 1e-4 behind AdamW: 5.356 vs 4.890); (2) Qwen3-0.6B packed with
# inductor's coordinate-descent tuning of the compiled layers' elementwise kernels (34 ms of the
# 304 ms step in s6_call3).
source "$(dirname "$0")/device_env.sh"
log converge
timeout 200 python3 bench/sft_converge.py --steps 200 --states 256 --only hf_adamw,pgs_adamw8bit \
  --out "$OUT/converge_adamw.json" >> "$OUT/all.log" 2>&1
timeout "$(left 300)" python3 bench/sft_converge.py --steps 200 --states 256 --lion-lr 3e-4 --only pgs_lion8bit \
  --out "$OUT/converge_lion3e-4.json" >> "$OUT/all.log" 2>&1
log sft 06b
timeout "$(left 450)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen >> "$OUT/all.log" 2>&1
timeout "$(left 580)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 --out "$OUT/sft_06b_cdt.json" \
  --only pgs_release_noac_varlen --compile-options '{"coordinate_descent_tuning": true}' >> "$OUT/all.log" 2>&1
log done
log_tail 10
