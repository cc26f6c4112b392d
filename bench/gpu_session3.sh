#!/bin/bash
# First device call of session 3 (one H200; carry ".whl": liger-kernel, cut-cross-entropy,
# bitsandbytes).  Issue 8: packed-document attention ("varlen") at Qwen3-0.6B 8x4096 against
# the HF baselines of the same call (with SDPA, and given the same varlen attention), and the
# 4B memory variants (offloaded layer inputs with a one-layer prefetch, the tied weight in row
# slabs, per-parameter release groups) beside HF's compiled layers.  Issue 4: the 8-bit kernel
# variants and an ncu profile (bench/experiments/issue4_s3.sh).  Then the Lion8bit convergence
# rerun.  Each piece has its own time limit; logs and JSON land in $OUT (8 files at most).
source "$(dirname "$0")/device_env.sh"
log pytest
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_attention_varlen.py tests/test_checkpoint_offload.py \
  2>&1 | tail -6 >> "$OUT/all.log"
log sft 0.6b
timeout 150 python3 bench/sft_step.py --shapes qwen3-0.6b --steps 5 --warmup 2 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen,hf_liger,hf_liger_varlen,pgs_release_noac,hf_compiled_varlen >> "$OUT/all.log" 2>&1
log sft 4b
timeout "$(left 320)" python3 bench/sft_step.py --shapes qwen3-4b --steps 5 --warmup 2 --out "$OUT/sft_4b.json" \
  --only pgs_release_slabs_pg,hf_compiled_ac,pgs_release_slabs,pgs_release >> "$OUT/all.log" 2>&1
if [ -z "$SKIP_ISSUE4" ] && [ -f bench/experiments/issue4_s3.sh ]; then
  log issue4
  timeout "$(left 490)" bash bench/experiments/issue4_s3.sh >> "$OUT/all.log" 2>&1
fi
log converge
timeout "$(left 585)" python3 bench/sft_converge.py --steps 120 --only pgs_lion8bit,hf_adamw --lion-lr 1e-4 \
  --out "$OUT/converge.json" >> "$OUT/all.log" 2>&1
log done
grep -v -i "warn\|^ *$\|This call\|  File \|dynamo\|USDT" "$OUT/all.log" | cut -c1-220 | tail -70
