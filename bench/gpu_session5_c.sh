#!/bin/bash
# Third device call of session 5 (one H200; carry ".whl", which holds py-spy): (1) the chain's
# fused-vs-generic CUDA test with the rounding-flip bound, checkpointing and slab tests on CUDA,
# (2) Qwen3-4B: HF against pgs with the recompute that runs the forward without autograd
# (checkpointing._Recompute, default) and with torch.utils.checkpoint (+slow), each then sampled
# by py-spy in steady state.
source "$(dirname "$0")/device_env.sh"
[ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl
export PATH=/tmp/spy/bin:$PATH
log pytest
cuda_tests 120 --tb=short "tests/test_chain8bit.py::test_fused_equals_generic_flat_path" tests/test_checkpointing.py tests/test_release_slabs.py
log sft 4b
timeout "$(left 560)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 --spy "$OUT/spy" \
  --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub+sf+pool,pgs_release_slabs_sub+sf+pool+slow,pgs_release \
  >> "$OUT/all.log" 2>&1
log done
for f in "$OUT"/spy.*.txt; do python3 bench/experiments/spy_summary.py "$f" --top 30 > "${f%.txt}.summary" 2>&1; done
cat "$OUT/pytest.log"
log_tail 8
python3 bench/summarize.py "$OUT/sft_4b.json"
