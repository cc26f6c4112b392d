#!/bin/bash
# A device call of session 4 (one H200; carry ".whl"): Qwen3-4B after the sync-free tied slabs,
# HF in the same call, host timers; then the chain and small-kernel tests on CUDA (full output).
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 300 python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub,pgs_release,pgs_release_slabs_pg \
  >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 400)" python3 -m pytest -q -p no:cacheprovider -x tests/test_chain8bit.py -k equals_generic 2>&1 \
  | grep -v "^W1129" | grep -E "^E |^>|assert|passed|failed|path" | head -30 > "$OUT/pytest.log"
timeout "$(left 430)" python3 -m pytest -q -p no:cacheprovider tests/test_small_kernel.py tests/test_release_slabs.py \
  tests/test_release_launches.py 2>&1 | tail -3 >> "$OUT/pytest.log"
log done
log_tail 12
cat "$OUT/pytest.log"
python3 - "$OUT/sft_4b.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    h = r.get("host_ms_per_step") or {}
    print(r["variant"], round(r.get("tok_s", 0)), {k: v for k, v in h.items() if k != "calls_per_step"})
PY
