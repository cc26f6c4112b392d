#!/bin/bash
# Session 6, device call 2 (one H200; carry ".whl"): (1) dense SDPA cuDNN vs FlashAttention-2 at
# the 4B shape (probe), (2) the attention tests on CUDA (one document per row through dense SDPA
# with cuDNN first), (3) Qwen3-4B with SDPA's cuDNN kernel first (pgs's "auto" on Hopper) against
# HF in PyTorch's order and HF given cuDNN too, (4) Qwen3-0.6B packed with the "auto" deferral.
source "$(dirname "$0")/device_env.sh"
log attn probe
timeout 120 python3 bench/experiments/attn_cudnn.py "$OUT/attn_cudnn.json" > "$OUT/attn.log" 2>&1
log pytest
cuda_tests 90 --tb=short tests/test_attention_varlen.py
log sft 4b
timeout "$(left 470)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,hf_compiled_ac+cudnn,pgs_release_slabs_sub,pgs_release_slabs_sub+fa2,pgs_release >> "$OUT/all.log" 2>&1
log sft 06b
timeout "$(left 570)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 \
  --only pgs_release_noac_varlen --out "$OUT/sft_06b.json" >> "$OUT/all.log" 2>&1
log done
grep dense "$OUT/attn.log" | cut -c1-900
cat "$OUT/pytest.log"
log_tail 10
python3 bench/summarize.py "$OUT"/sft_*.json
