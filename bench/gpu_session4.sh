#!/bin/bash
# First device call of session 4 (one H200; carry ".whl").
# 1. issue #4: the 8-bit step kernels with the parameter loaded early (EARLY_P), a register cap,
#    2/4/8 blocks per program; each row also timed back to back (host ahead) and the default
#    rows' kernels listed (torch.profiler); bitsandbytes and torch fused AdamW in the same run.
# 2. issue #8: Qwen3-4B, where the host time of a step goes (--host-timers), HF in the same call.
# 3. issue #8: Qwen3-0.6B 8x4096 packed, a torch.profiler summary of pgs's fastest variant.
source "$(dirname "$0")/device_env.sh"
log optim_8bit
timeout 260 python3 bench/optim_8bit.py "$OUT/optim_8bit.json" --budget 230 --only \
pgs_lion8bit,pgs_lion8bit_early,pgs_lion8bit_rows4,pgs_lion8bit_rows4_early,pgs_lion8bit_early_reg64,\
pgs_lion8bit_rows2_early,pgs_lion8bit_sr,pgs_lion8bit_sr_early,pgs_lion8bit_sr_rows4_early,pgs_adamw8bit,\
pgs_adamw8bit_early,pgs_adamw8bit_rows2_early,bnb_lion8bit,bnb_adamw8bit,torch_adamw_fused_bf16,pgs_lion8bit_repeat \
  > "$OUT/optim_8bit.log" 2>&1
log sft 4b
timeout "$(left 500)" python3 bench/sft_step.py --shapes qwen3-4b --steps 8 --warmup 2 --host-timers 2 \
  --out "$OUT/sft_4b.json" --only hf_compiled_ac,pgs_release,pgs_release_slabs_sub,pgs_release_slabs_pg \
  >> "$OUT/all.log" 2>&1
log sft 06b profile
timeout "$(left 580)" python3 bench/sft_step.py --shapes qwen3-0.6b --steps 4 --warmup 2 --profile 2 --host-timers 2 \
  --out "$OUT/sft_06b.json" --only pgs_release_noac_varlen >> "$OUT/all.log" 2>&1
log done
log_tail 30
python3 - "$OUT/optim_8bit.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["rows"].items():
    print(f"{k:32s}", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items()
                       if x in ("ms", "fraction_of_copy_bw", "back_to_back_ms", "back_to_back_fraction_of_copy_bw",
                                "host_ms_per_step", "error", "skipped")})
PY
