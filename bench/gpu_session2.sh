#!/bin/bash
# One device call (H200) of the second session: issue 8's SFT comparisons, the optimizer rows
# changed this session (global-norm clip, fused AdamW now really called), the convergence check
# and the CUDA-marked tests.  Run from the repo root with the wheels in .whl/ (carry ".whl").
# Every log and JSON lands in $OUT; each step has its own time limit so a slow one cannot eat
# the others'.
source "$(dirname "$0")/device_env.sh"
log sft 4b
timeout 190 python3 bench/sft_step.py --shapes qwen3-4b --only pgs_release,hf_compiled_ac --steps 4 --warmup 2 --out "$OUT/sft_4b.json" >> "$OUT/all.log" 2>&1
log sft 0.6b
timeout 150 python3 bench/sft_step.py --shapes qwen3-0.6b --only pgs_release,hf_liger --steps 4 --warmup 2 --out "$OUT/sft_06b.json" >> "$OUT/all.log" 2>&1
log optim_step
timeout 60 python3 bench/optim_step.py --out "$OUT/optim_step.json" --only torch_adamw_fused_bf16,pgs_adamw_bf16_state,pgs_adamw_bf16_generic_compile,pgs_adamw_clip_cosine >> "$OUT/all.log" 2>&1
log converge
timeout "$(left 520)" python3 bench/sft_converge.py --steps 60 --out "$OUT/converge.json" >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 565)" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_interpret.py tests/test_release_fused.py tests/test_release_defer.py tests/test_fused_kernels.py tests/test_losses_kernels.py tests/test_muon_fast.py > "$OUT/pytest.log" 2>&1
log done
grep -v -i "warn\|^ *$\|This call\|  File \|dynamo" "$OUT/all.log" | tail -60
tail -5 "$OUT/pytest.log"
