#!/bin/bash
# Session 6, device call 3 (one H200; carry ".whl"): profiles (torch.profiler, 2 steps) of the
# Qwen3-4B rows of call 2 (does the compiled layer's SDPA take cuDNN? is the step host-bound?)
# and of Qwen3-0.6B packed without the head deferral (what is left besides matmuls).
source "$(dirname "$0")/device_env.sh"
log sft 4b profile
timeout 330 python3 bench/sft_step.py --shapes qwen3-4b --steps 4 --warmup 2 --profile 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac+cudnn,pgs_release_slabs_sub,pgs_release_slabs_sub+fa2 >> "$OUT/all.log" 2>&1
log sft 06b profile
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 4 --warmup 2 --profile 2 \
  --only pgs_release_noac_varlen --out "$OUT/sft_06b.json" >> "$OUT/all.log" 2>&1
log done
log_tail 8
python3 - "$OUT"/sft_4b.json "$OUT"/sft_06b.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))["results"]:
        p = r.get("profile") or {}
        print(r["variant"], round(r.get("tok_s", 0)), "busy", p.get("cuda_busy_ms_per_step"), "wall", p.get("wall_ms_per_step"),
              "idle", p.get("cuda_idle_ms_per_step"))
        print("  class", p.get("gpu_ms_by_class"))
        for k in (p.get("top_kernels") or [])[:8]:
            print("  ", round(k["ms_per_step"], 1), k["calls_per_step"], k["name"][:90])
PY
