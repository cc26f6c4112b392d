#!/usr/bin/env bash
# One device call: 8-bit step (both dequantize modes) and batched Muon, Qwen3-1.7B shapes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 bench/optim_8bit.py "$OUT/optim_8bit.json" --iters 10 2>&1 | grep -v -i warn | tail -12
PGS_DEQ_TABLE=1 python3 bench/optim_8bit.py "$OUT/optim_8bit_deqtable.json" --iters 10 2>&1 | grep -v -i warn | tail -12
timeout 200 python3 bench/muon_bench.py "$OUT/muon.json" --iters 5 --dtype bfloat16 2>&1 | grep -v -i warn | tail -8
