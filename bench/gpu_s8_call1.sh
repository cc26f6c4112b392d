#!/bin/bash
# Session 8, call 1 (one H200; carry ".whl" with the nvidia_cudnn_frontend wheel): (1) CUDA tests
# of the attention, fused-release, loss, offload and profile files; (2) the final code's
# Qwen3-0.6B packed step (pad_documents' minimum of two zero-length documents, written after the
# last call of session 7) against HF + Liger on causal rows, in one run.
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 170 -n 4 --tb=line tests/test_attention_varlen.py tests/test_release_fused.py tests/test_losses.py \
  tests/test_checkpoint_offload.py tests/test_profile.py
log sft 06b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen,hf_liger_causal >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ.get("OUT", "/tmp/out") + "/sft_06b.json")).get("results", []):
    print({k: r.get(k) for k in ("variant", "tok_s", "mfu", "peak_gib", "error")})
PY
log_tail 8
