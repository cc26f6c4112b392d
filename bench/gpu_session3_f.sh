#!/bin/bash
# Sixth device call of session 3 (one H200; carry ".whl"): Qwen3-4B with the "sublayer"
# checkpoint policy (attention half and MLP half checkpointed apart, inputs offloaded) + tied
# slabs, per-parameter and per-layer release groups, beside pgs_release and HF in the same
# call (each variant in its own process); then the tiled-MLP tests with their output.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 230 python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_pg_sub,pgs_release,pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 275)" python3 -m pytest -q -p no:cacheprovider -x tests/test_tiled_mlp.py tests/test_checkpoint_sublayer.py \
  2>&1 | grep -v "^W1129" | tail -40 > "$OUT/pytest.log"
log done
log_tail 20
tail -25 "$OUT/pytest.log"
