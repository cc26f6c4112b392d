#!/bin/bash
# Session 6, device call 4 (one H200; carry ".whl"): (1) the attention tests on CUDA (unpacked rows
# through dense SDPA), (2) Qwen3-4B: HF against pgs <= 12 GiB with SDPA and with the varlen path
# (its unpacked rows now dense SDPA), (3) Qwen3-0.6B 8x4096: every HF + Liger baseline (SDPA with
# transformers' block mask, plain causal rows as ANCHORS.md measured, pgs's varlen kernel) and pgs.
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 90 --tb=short tests/test_attention_varlen.py
log sft 4b
timeout 200 python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub,pgs_release_slabs_sub_varlen >> "$OUT/all.log" 2>&1
log sft 06b
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 --out "$OUT/sft_06b.json" \
  --only hf_liger,hf_liger_causal,hf_liger_varlen,pgs_release_noac_varlen >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 10
python3 bench/summarize.py "$OUT"/sft_*.json
