#!/bin/bash
# Prepared at the end of session 5 for the next device call (one H200; carry ".whl"): what
# session 5 changed after its last measurement, not yet run on a GPU: (1) the CUDA offload test
# (tests/test_checkpoint_offload.py::test_offload_on_cuda_keeps_loss_and_grads) and the
# recompute's tests on CUDA, (2) Qwen3-4B <= 12 GiB against HF after the recompute stopped
# holding its output through the nested backward (s5_call6 peaked at 12.019 GiB with that leak;
# expected 11.998-11.999 as in s5_call4/5).
source "$(dirname "$0")/device_env.sh"
log pytest
cuda_tests 240 --tb=line tests/test_checkpoint_offload.py tests/test_checkpointing.py tests/test_checkpoint_sublayer.py tests/test_chain8bit.py
log sft 4b
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-4b --steps 10 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release_slabs_sub,pgs_release >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 6
python3 bench/summarize.py "$OUT/sft_4b.json"
# (3) Qwen3-0.6B 8x4096 packed without the head-gradient deferral (one head matmul less per
# step; memory is not the constraint there), against the default, HF + Liger + varlen in the
# same call:
#   python3 bench/sft_step.py --shapes qwen3-0.6b --only hf_liger_varlen,pgs_release_noac_varlen --out A.json
#   python3 bench/sft_step.py --shapes qwen3-0.6b --only pgs_release_noac_varlen --no-defer --out B.json
