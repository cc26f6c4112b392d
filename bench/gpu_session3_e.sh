#!/bin/bash
# Fifth device call of session 3 (one H200; carry ".whl"): Qwen3-4B after the host-time cuts
# (small parameters grouped per layer in per-parameter mode, small leaves stepped as one,
# the tiled MLP's SwiGLU as one fused in-place pass, 5 tied-weight slabs instead of 19),
# each variant in its own process, HF in the same call; the tiled row with 4 and 8 tiles.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 250 python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_pg_tiled,pgs_release,pgs_release_slabs_pg >> "$OUT/all.log" 2>&1
log sft 4b tiles 8
timeout "$(left 320)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --mlp-tiles 8 --profile 2 \
  --out "$OUT/sft_4b_t8.json" --only pgs_release_slabs_pg_tiled >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 370)" python3 -m pytest -q -p no:cacheprovider tests/test_tiled_mlp.py 2>&1 | tail -3 >> "$OUT/all.log"
log done
log_tail 30
