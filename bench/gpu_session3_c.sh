#!/bin/bash
# Third device call of session 3 (one H200; carry ".whl").  Issue 4: the 8-bit rows with the
# gradients bound as the runtime binds them (the earlier rows paid a zero-fill + copy of the
# gradient per step), the gather_dec variants, bitsandbytes and torch fused AdamW in the same
# run.  Issue 8: the 4B rows again (8 timed steps, one process each) after the per-call launch
# cuts.  Then the CUDA-marked tests of the files changed this session.
source "$(dirname "$0")/device_env.sh"
log optim_8bit
timeout 170 python3 bench/optim_8bit.py "$OUT/optim_8bit.json" --budget 140 --only \
pgs_lion8bit,pgs_adamw8bit,torch_adamw_fused_bf16,bnb_lion8bit,bnb_adamw8bit,pgs_lion8bit_unbound,pgs_lion8bit_gather_dec,\
pgs_adamw8bit_gather_dec,pgs_lion8bit_gather_dec_w8,pgs_lion8bit_gather_dec_rows16,pgs_chain,pgs_lion8bit_sr,pgs_lion8bit_repeat \
  2>&1 | grep -v -i warn | cut -c1-160 >> "$OUT/all.log"
log sft 4b
timeout "$(left 420)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --out "$OUT/sft_4b.json" \
  --only hf_compiled_ac,pgs_release_slabs_pg_tiled,pgs_release,pgs_release_slabs_pg >> "$OUT/all.log" 2>&1
log pytest
timeout "$(left 500)" python3 -m pytest -q -p no:cacheprovider tests/test_release_fused.py tests/test_fused_kernels.py \
  tests/test_tiled_mlp.py tests/test_attention_varlen.py 2>&1 | tail -4 >> "$OUT/all.log"
log done
log_tail 50
