#!/bin/bash
# Session 6, device call 1 (one H200; carry ".whl"): (1) cuDNN vs flash variable-length attention
# probe, (2) the CUDA tests of session 5's recompute/offload and the chain, (3) Qwen3-4B <= 12 GiB
# against HF after session 5's leak fix, (4) Qwen3-0.6B packed with and without the deferred head.
source "$(dirname "$0")/device_env.sh"
log attn probe
timeout 150 python3 bench/experiments/attn_cudnn.py "$OUT/attn_cudnn.json" > "$OUT/attn.log" 2>&1
log pytest
cuda_tests 200 --tb=line tests/test_checkpoint_offload.py tests/test_checkpointing.py tests/test_checkpoint_sublayer.py tests/test_chain8bit.py
log sft 4b
timeout "$(left 420)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub,pgs_release >> "$OUT/all.log" 2>&1
log sft 06b
timeout "$(left 520)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 \
  --only hf_liger_varlen,pgs_release_noac_varlen --out "$OUT/sft_06b.json" >> "$OUT/all.log" 2>&1
timeout "$(left 580)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 2 \
  --only pgs_release_noac_varlen --no-defer --out "$OUT/sft_06b_nodefer.json" >> "$OUT/all.log" 2>&1
log done
tail -30 "$OUT/attn.log" | cut -c1-400
cat "$OUT/pytest.log"
log_tail 8
python3 bench/summarize.py "$OUT"/sft_*.json
