#!/bin/bash
# Session 7, call 1 (prepared at the end of session 6) (one H200; carry ".whl", which must
# hold nvidia_cudnn_frontend-1.32.0-cp312-*.whl beside the other wheels, 57.6 MiB in all:
#   pip download nvidia-cudnn-frontend==1.32.0 --no-deps --python-version 3.12 --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 -d .whl
# ). Not run yet. The 0.6B packed step spends 79.5 of its 304 ms in FlashAttention-2 (s6_call3);
# cuDNN's dense kernel was 1.9x faster than FA2 at the 4B shape (s6_call2). This call asks
# whether cuDNN's THD (packed) SDPA through the frontend's torch op is exact and faster there:
# (1) the probe: error against fp32, fwd+bwd time, a new document count, zero-length padding,
# torch.compile; (2) Qwen3-0.6B 8x4096 packed: pgs and HF + Liger with varlen attention through
# FA2 and through cuDNN THD (+cudnnthd), against ANCHORS.md's unisolated HF + Liger setup.
source "$(dirname "$0")/device_env.sh"
log attn probe
timeout 150 python3 bench/experiments/attn_cudnn.py --frontend-only "$OUT/attn_fe.json" > "$OUT/attn.log" 2>&1
log sft 06b
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 6 --warmup 3 --out "$OUT/sft_06b.json" \
  --only hf_liger_causal,pgs_release_noac_varlen,pgs_release_noac_varlen+cudnnthd,hf_liger_varlen+cudnnthd \
  >> "$OUT/all.log" 2>&1
log done
grep "^{" "$OUT/attn.log" | cut -c1-600
log_tail 8
