#!/bin/bash
# Second device call of session 5 (one H200; carry ".whl", which holds py-spy): (1) the chain's
# fused-vs-generic CUDA test with its numbers, (2) where the host time of Qwen3-4B <= 12 GiB
# goes (py-spy, all threads, bench/experiments/spy_summary.py), (3) HF against the <= 12 GiB
# variant with and without the checkpoint's RNG-state save.
source "$(dirname "$0")/device_env.sh"
[ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl
export PATH=/tmp/spy/bin:$PATH
log pytest
cuda_tests 100 --tb=short "tests/test_chain8bit.py::test_fused_equals_generic_flat_path"
log spy
timeout 200 py-spy record -r 250 --nonblocking --threads -f raw -o "$OUT/spy.txt" -- \
  python3 bench/sft_step.py --same-process --shapes qwen3-4b --steps 16 --warmup 2 \
  --only pgs_release_slabs_sub+sf+pool --out "$OUT/spy_sft.json" >> "$OUT/all.log" 2>&1
python3 bench/experiments/spy_summary.py "$OUT/spy.txt" --top 45 --json "$OUT/spy_summary.json" > "$OUT/spy_summary.txt" 2>&1
log sft 4b
timeout "$(left 540)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_sub+sf+pool,pgs_release_slabs_sub+sf+pool+rng,pgs_release \
  >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 8
head -75 "$OUT/spy_summary.txt"
python3 bench/summarize.py "$OUT/sft_4b.json"
