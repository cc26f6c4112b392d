#!/bin/bash
# Session 7, call 3 (one H200; carry ".whl"). cuDNN's THD kernel is now pgs's packed-attention
# path on an H200 (model.varlen_kernel = "auto"; document counts padded to 64). (1) CUDA tests of
# the attention file and the files whose paths run attention; (2) Qwen3-0.6B 8x4096 packed:
# pgs (auto = cuDNN) and with FA2 (+fa2), HF + Liger unisolated (ANCHORS.md's setup) and HF +
# Liger on pgs's varlen kernel (auto = cuDNN); (3) convergence: pgs adamw8bit with an fp32
# master against HF AdamW (is s7_call2's post-plateau gap the precision?), Lion at lr 3e-5;
# (4) the probe's padding/determinism section.
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 130 -n 4 --tb=line tests/test_attention_varlen.py tests/test_profile.py tests/test_release_fused.py \
  tests/test_checkpoint_offload.py tests/test_losses.py
log sft 06b
timeout "$(left 330)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 8 --warmup 3 --out "$OUT/sft_06b.json" \
  --only pgs_release_noac_varlen,hf_liger_causal,pgs_release_noac_varlen+fa2,hf_liger_varlen \
  >> "$OUT/all.log" 2>&1
log converge
timeout "$(left 450)" python3 bench/sft_converge.py --steps 200 --states 256 --master --only hf_adamw,pgs_adamw8bit \
  --out "$OUT/converge_master.json" >> "$OUT/all.log" 2>&1
timeout "$(left 520)" python3 bench/sft_converge.py --steps 200 --states 256 --lion-lr 3e-5 --only pgs_lion8bit \
  --out "$OUT/converge_lion3e-5.json" >> "$OUT/all.log" 2>&1
log probe
timeout "$(left 575)" python3 bench/experiments/attn_cudnn.py --frontend-pad "$OUT/attn_pad.json" > "$OUT/attn.log" 2>&1
log done
cat "$OUT/pytest.log"
grep "^{" "$OUT/attn.log" | cut -c1-700
log_tail 14
