#!/bin/bash
# Last device call of session 4 (one H200; carry ".whl"): why four slab/launch tests failed on
# CUDA in call e (one line per failure), then Qwen3-4B <= 12 GiB against HF after the pinned
# buffer pool of the offload.
source "$(dirname "$0")/device_env.sh"
log pytest
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_release_slabs.py tests/test_release_launches.py \
  2>&1 | grep -v "^W1129" | grep -E "Error|assert|FAILED|passed|failed" | cut -c1-300 | head -16 > "$OUT/pytest.log"
log sft 4b
timeout "$(left 175)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
grep -v -i "warn\|^ *$\|This call\|  File \|dynamo\|USDT\|^W1129" "$OUT/all.log" | cut -c1-200 | tail -6
python3 - "$OUT/sft_4b.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    h = r.get("host_ms_per_step") or {}
    print(r["variant"], round(r.get("tok_s", 0)), {k: v for k, v in h.items() if k != "calls_per_step"})
PY
