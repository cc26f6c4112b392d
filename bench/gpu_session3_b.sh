#!/bin/bash
# Second device call of session 3 (one H200; carry ".whl").  Issue 8 at 4B: the tiled MLP on
# top of offloaded inputs + tied slabs + per-parameter release groups, each variant in its own
# process (sft_step.py's default), with a profile of the tiled row; 0.6B packed: pgs with Liger's
# layer kernels vs compiled layers, both with varlen attention, beside HF + Liger + varlen.
# Issue 4: bench/experiments/issue4_s3.sh (8-bit kernel variants + ncu).  Logs in $OUT.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 210 python3 bench/sft_step.py --shapes qwen3-4b --steps 6 --warmup 2 --profile 2 --out "$OUT/sft_4b.json" \
  --only pgs_release_slabs_pg_tiled,hf_compiled_ac,pgs_release_slabs_pg,pgs_release >> "$OUT/all.log" 2>&1
log sft 0.6b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 5 --warmup 2 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_liger_varlen,hf_liger_varlen,pgs_release_noac_varlen >> "$OUT/all.log" 2>&1
log issue4
OUT4="$OUT/i4"; mkdir -p "$OUT4"
OUT="$OUT4" timeout "$(left 540)" bash bench/experiments/issue4_s3.sh > "$OUT/issue4_stdout.txt" 2>&1
log done
grep -v -i "warn\|^ *$\|This call\|  File \|dynamo\|USDT\|^W1129" "$OUT/all.log" | cut -c1-240 | tail -60
tail -30 "$OUT4/log.txt" 2>/dev/null | cut -c1-200
