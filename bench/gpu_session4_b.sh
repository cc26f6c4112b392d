#!/bin/bash
# Second/third device call of session 4 (one H200; carry ".whl").
# 1. issue #4: defaults now (EARLY_P on, the flatten cache), the previous default (late p),
#    bitsandbytes, torch fused AdamW, the generic chain and the hand-written chain passes.
# 2. host cost of the release pieces (bench/experiments/host_costs.py).
# 3. issue #8: Qwen3-4B with the release host-time cuts, HF in the same call; a profile of the
#    <= 12 GiB variant with the phases annotated.
# 4. the CUDA runs of the kernel tests touched this session.
source "$(dirname "$0")/device_env.sh"
log optim_8bit
timeout 250 python3 bench/optim_8bit.py "$OUT/optim_8bit.json" --budget 220 --isolate pgs_chain,pgs_chain_fused --only \
pgs_lion8bit,pgs_adamw8bit,torch_adamw_fused_bf16,bnb_lion8bit,bnb_adamw8bit,pgs_chain,pgs_chain_fused,\
pgs_lion8bit_late,pgs_adamw8bit_late,pgs_lion8bit_sr,pgs_lion8bit_repeat \
  > "$OUT/optim_8bit.log" 2>&1
log host costs
timeout 60 python3 bench/experiments/host_costs.py "$OUT/host_costs.json" >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 420)" python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels_interpret.py tests/test_chain8bit.py \
  tests/test_small_kernel.py tests/test_deferred_kernels.py tests/test_release_fused.py \
  2>&1 | grep -v "^W1129" | tail -15 > "$OUT/pytest.log"
log done
log_tail 30
python3 - "$OUT/optim_8bit.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["rows"].items():
    print(f"{k:26s}", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items()
                       if x in ("ms", "fraction_of_copy_bw", "back_to_back_ms", "back_to_back_fraction_of_copy_bw",
                                "host_ms_per_step", "ratio_to_floor", "error", "skipped")})
PY
tail -5 "$OUT/pytest.log"
