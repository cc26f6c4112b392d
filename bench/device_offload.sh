#!/bin/bash
# The offload suite on one H200 (carry ".whl"): bench/offload_bench.py, i.e. host<->device
# bandwidth, `pgs run specs/qwen3_8b_20gib.toml` (state offloaded), HF compiled + AC + fused AdamW
# at the same shape, and the 4B recipe with and without memory.offload_optimizer, each with its
# own timeout inside one budget.  Environment: STEPS (default 16: the mean is over steps 5-16),
# ONLY (setups, comma-separated, default: bandwidth,pgs_8b_offload,hf_8b_compiled_ac,pgs_4b,
# pgs_4b_offload; python bench/offload_bench.py --help lists the others), SAVE_EVERY (the
# *_saves setups' checkpoint.every, default 40), TESTS (1: first the CUDA tests of the offload, tests/unit/test_offload.py, ~1 min;
# anything else: pytest arguments run first, e.g. TESTS="-m cuda tests/unit/test_pinned.py"; TEST_S
# seconds for them, default 150),
# BUDGET (seconds for the setups, default 560 less the tests' time).  Results: $OUT/offload.json
# (rewritten after every setup, so a cut-off call keeps what finished), $OUT/all.log,
# $OUT/pytest.log.
source "$(dirname "$0")/device_env.sh"
STEPS=${STEPS:-16}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/all.log"
free -g >> "$OUT/all.log"
if [ "${TESTS:-0}" = 1 ]; then
  log cuda tests
  cuda_tests 100 -m cuda --tb=short tests/unit/test_offload.py
elif [ -n "${TESTS:-}" ] && [ "$TESTS" != 0 ]; then
  log pytest $TESTS
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  cuda_tests "${TEST_S:-150}" --tb=short $TESTS
fi
log offload bench
BUDGET=${BUDGET:-$(left 565)}
python3 bench/offload_bench.py --steps "$STEPS" --budget "$BUDGET" --workdir /tmp/offload --save-every "${SAVE_EVERY:-40}" \
  ${ONLY:+--only $ONLY} --out "$OUT/offload.json" >> "$OUT/all.log" 2>&1
log done
[ -f "$OUT/pytest.log" ] && cat "$OUT/pytest.log"
grep -E "^\||GB/s|Error|error" "$OUT/all.log" | cut -c1-300 | tail -24
