#!/bin/bash
# Issue 19 (one H200 host): StepLoader's CUDA tests (worker process and thread) and training-like
# steps fed by it on CUDA (3000 launches + 300 ms of device time a step; --overlap).  The first
# call of this script (with ".bench_base" carried, the pipeline at a2c69f0) also timed the CPU
# throughput before and after; its numbers are in docs/performance.md.
source "$(dirname "$0")/device_env.sh"
python3 -c "import sys, torch, transformers, tokenizers; print('versions', sys.version.split()[0], torch.__version__, \
transformers.__version__, tokenizers.__version__, torch.cuda.is_available(), torch.get_num_threads())" >> "$OUT/all.log" 2>&1
log tests
cuda_tests 200 tests/test_data_loader.py tests/test_release_prefetch.py
log overlap
timeout "$(left 420)" python3 bench/data_pipeline.py --windows 0.2 --all-cores --overlap 60 --out "$OUT/overlap.json" \
  >> "$OUT/all.log" 2>&1
log done
cat "$OUT/pytest.log"
log_tail 12
