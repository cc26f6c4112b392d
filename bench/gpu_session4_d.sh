#!/bin/bash
# A device call of session 4 (one H200; carry ".whl"): after the release host-time cuts and the
# small-leaf kernel: (1) the CUDA runs of this session's tests, (2) Qwen3-4B, HF in the same
# call, host timers per phase, (3) the chain passes' pass-A block count and sum slots.
source "$(dirname "$0")/device_env.sh"
log pytest
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_chain8bit.py tests/test_small_kernel.py \
  tests/test_release_launches.py tests/test_kernels_interpret.py tests/test_release_fused.py tests/test_deferred_kernels.py \
  2>&1 | grep -v "^W1129" | tail -40 > "$OUT/pytest.log"
log sft 4b
timeout "$(left 420)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release,pgs_release_slabs_sub,pgs_release_slabs_pg_sub,pgs_release_slabs_pg \
  >> "$OUT/all.log" 2>&1
log optim chain
timeout "$(left 560)" python3 bench/optim_8bit.py "$OUT/optim_chain.json" --budget "$(left 500)" --trace "" \
  --isolate pgs_chain_fused,pgs_chain_fused_a16,pgs_chain_fused_lanes512,pgs_chain_fused_a16_lanes512 \
  --only pgs_lion8bit,pgs_chain_fused,pgs_chain_fused_a16,pgs_chain_fused_lanes512,pgs_chain_fused_a16_lanes512,bnb_lion8bit \
  > "$OUT/optim_chain.log" 2>&1
log done
log_tail 20
grep -E "passed|failed|^E " "$OUT/pytest.log" | head -12
python3 - "$OUT/optim_chain.json" "$OUT/sft_4b.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["rows"].items():
    print(f"{k:28s}", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items()
                       if x in ("ms", "back_to_back_ms", "ratio_to_floor", "host_ms_per_step", "error")})
for r in json.load(open(sys.argv[2]))["results"]:
    h = r.get("host_ms_per_step") or {}
    print(r["variant"], round(r.get("tok_s", 0)), {k: v for k, v in h.items() if k != "calls_per_step"})
PY
