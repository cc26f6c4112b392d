#!/bin/bash
# The product benchmark on one H200 (carry ".whl": liger-kernel, cut-cross-entropy, bitsandbytes,
# nvidia-cudnn-frontend): bench/product.py on both shipped recipes, each beside its HF peer in
# the same call.  Environment: STEPS (default 40), WHICH ("06b,4b"), PROFILE ("A:B": a trace of
# those steps of the 0.6B pgs run; its operator table lands in $OUT), EXTRA (more product.py
# arguments for every spec), TESTS (1, the default: first the CUDA tests of the product path,
# tests/integration/test_train_steady.py and tests/integration/test_data_loader.py).  Results: $OUT/product_<shape>.json,
# $OUT/pytest.log and $OUT/all.log.
source "$(dirname "$0")/device_env.sh"
STEPS=${STEPS:-40}
WHICH=${WHICH:-06b,4b}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/all.log"
if [ "${TESTS:-1}" = 1 ]; then  # the product path's CUDA tests first (failure lines in $OUT/pytest.log)
  log cuda tests
  cuda_tests 150 -m cuda --tb=line tests/integration/test_train_steady.py tests/integration/test_data_loader.py
fi
if [[ $WHICH == *06b* ]]; then
  log product 06b
  timeout "$(left 400)" python3 bench/product.py --spec specs/qwen3_0.6b_packed.toml --steps "$STEPS" \
    --peer hf_liger_causal --harness pgs_release_noac_varlen ${PROFILE:+--profile $PROFILE} \
    --workdir /tmp/p06b --out "$OUT/product_06b.json" $EXTRA >> "$OUT/all.log" 2>&1
  [ -f /tmp/p06b/run/profile/ops.txt ] && cp /tmp/p06b/run/profile/ops.txt "$OUT/ops_06b.txt"
fi
if [[ $WHICH == *4b* ]]; then
  log product 4b
  timeout "$(left 585)" python3 bench/product.py --spec specs/qwen3_4b_12gib.toml --steps "$STEPS" \
    --peer hf_compiled_ac --workdir /tmp/p4b --out "$OUT/product_4b.json" $EXTRA >> "$OUT/all.log" 2>&1
fi
log done
[ -f "$OUT/pytest.log" ] && cat "$OUT/pytest.log"
grep -E "^\||Error|error" "$OUT/all.log" | cut -c1-300 | tail -20
