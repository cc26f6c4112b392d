#!/bin/bash
# A device call of session 4 (one H200; carry ".whl"): the fused chain passes (issue #4): their
# CUDA tests with the failure shown, and their block counts / direction storage timed, with the
# generic graph and Lion8bit in the same run.
source "$(dirname "$0")/device_env.sh"
log chain tests
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_chain8bit.py 2>&1 | grep -v "^W1129" | tail -60 > "$OUT/chain_tests.log"
log optim chain
timeout 250 python3 bench/optim_8bit.py "$OUT/optim_chain.json" --budget 220 --trace pgs_chain_fused \
  --isolate pgs_chain,pgs_chain_fused,pgs_chain_fused_rows8,pgs_chain_fused_rows2,pgs_chain_fused_c16,pgs_chain_fused_int8 \
  --only pgs_lion8bit,pgs_chain,pgs_chain_fused,pgs_chain_fused_rows8,pgs_chain_fused_rows2,pgs_chain_fused_c16,pgs_chain_fused_int8 \
  > "$OUT/optim_chain.log" 2>&1
log done
grep -E "passed|failed|Error|assert" "$OUT/chain_tests.log" | head -20
python3 - "$OUT/optim_chain.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["rows"].items():
    print(f"{k:26s}", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items()
                       if x in ("ms", "back_to_back_ms", "ratio_to_floor", "host_ms_per_step", "error")})
    if "trace" in r:
        print("   ", [(t["name"][:30], t["ms"], t["calls"]) for t in r["trace"]["kernels"][:8]])
PY
