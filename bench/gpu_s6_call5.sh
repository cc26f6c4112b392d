#!/bin/bash
# Session 6, device call 5 (one H200; carry ".whl"): the launching stacks of the eager aten work
# in one Qwen3-0.6B packed pgs step (57 bf16 reductions, 8 ms per step, in s6_call3's profile).
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 bench/experiments/reduce_stacks.py pgs_release_noac_varlen qwen3-0.6b > "$OUT/stacks.txt" 2>&1
grep -v -i "warn\|USDT\|^W11" "$OUT/stacks.txt" | head -150 | cut -c1-170
