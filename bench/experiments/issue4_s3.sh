#!/bin/bash
# Issue #4, step 3 (one H200, torch 2.11 / Triton 3.6, pgs not installed; bitsandbytes in
# /tmp/site if the caller put it there): TABLE=gather (the tables in registers, tl.gather)
# against the default global-memory gathers.
#   (b) ncu --clock-control none of ONE lion8bit_kernel launch per mode (default, gather)
#       over a ~105M-element flat buffer (bench/experiments/ncu_lion8bit.py);
#   (a) bench/optim_8bit.py rows at Qwen3-1.7B shapes: lion8bit / adamw8bit default vs
#       gather / gather_dec, gather with ROWS / WARPS combos, bitsandbytes Lion8bit, and the
#       defaults again at the end (the first row runs on a cold GPU).
# The profile runs first (fixed time); the bench takes what is left of LIMIT (165 s): its
# JSON is rewritten after every row, so a kill keeps the rows already measured.
# Writes 3 files into $OUT: log.txt, ncu_lion8bit.txt, optim_8bit.json.  Every step may
# fail without stopping the others.
#   bash bench/experiments/issue4_s3.sh          # from the repo root; OUT=/tmp/out by default
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD
PY=${PY:-python3}
LIMIT=${LIMIT:-165}   # seconds for the whole script (the caller allows 170)
T_NCU=${T_NCU:-36}    # per ncu run (python + CUDA init + Triton compile + ~20 replay passes)
# dry runs only (CPU): BENCH_ARGS=--small, DRIVER_ARGS="--n 8192" (both empty on the H200)
BENCH_ARGS=${BENCH_ARGS:-}
DRIVER_ARGS=${DRIVER_ARGS:-}
LOG="$OUT/log.txt"
NCU_TXT="$OUT/ncu_lion8bit.txt"
: > "$LOG"
: > "$NCU_TXT"
log() { echo "[issue4_s3 +${SECONDS}s] $*" | tee -a "$LOG"; }

log "repo $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed files"
[ -d /tmp/site ] || log "note: /tmp/site is missing (no bitsandbytes: its row will record the ImportError)"
nvidia-smi -L >> "$LOG" 2>&1 || log "nvidia-smi failed"
timeout -k 2 20 "$PY" -c "
import torch, triton, triton.language as tl
print('torch', torch.__version__, 'triton', triton.__version__, 'tl.gather', hasattr(tl, 'gather'))
try:
    import bitsandbytes as b; print('bitsandbytes', b.__version__)
except Exception as e:
    print('bitsandbytes: not importable:', type(e).__name__, e)
" >> "$LOG" 2>&1 || log "version check failed (exit $?)"

# ---- (b) ncu: one launch of the default kernel and one of the gather variant ----------------
NCU=$(command -v ncu 2>/dev/null)
if [ -z "$NCU" ]; then
  for c in /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    [ -x "$c" ] && { NCU=$c; break; }
  done
fi
if [ -z "$NCU" ]; then
  log "ncu not found: no profile" | tee -a "$NCU_TXT"
else
  NCU_OPTS=(--clock-control none --print-summary none --page details
            --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis
            --section WarpStateStats --section SourceCounters
            -k regex:lion8bit --launch-skip 2 --launch-count 1)
  HELP=$(timeout 10 "$NCU" --help 2>&1)
  # the L1 / shared-memory tables (wavefronts per request, bank conflicts) and section bodies
  # where this ncu has them
  echo "$HELP" | grep -q -- "--print-details" && NCU_OPTS+=(--print-details all)
  timeout 10 "$NCU" --list-sections 2>/dev/null | grep -q "MemoryWorkloadAnalysis_Tables" \
    && NCU_OPTS+=(--section MemoryWorkloadAnalysis_Tables)
  log "ncu: $NCU ($(timeout 10 "$NCU" --version 2>/dev/null | tail -1)) ${NCU_OPTS[*]}"
  for table in global gather; do
    {
      echo "=================================================================================="
      echo "== lion8bit_kernel, TABLE=$table (launch 3 of 3; ~105M elements, bf16, apply, no SR)"
      echo "=================================================================================="
    } >> "$NCU_TXT"
    t0=$SECONDS
    timeout -k 5 "$T_NCU" "$NCU" "${NCU_OPTS[@]}" "$PY" bench/experiments/ncu_lion8bit.py --table "$table" \
      $DRIVER_ARGS >> "$NCU_TXT" 2>&1
    rc=$?
    echo "== exit $rc after $((SECONDS - t0)) s" >> "$NCU_TXT"
    log "ncu TABLE=$table: exit $rc after $((SECONDS - t0)) s"
  done
fi

# ---- (a) the bench rows -------------------------------------------------------------------
ROWS=pgs_lion8bit,pgs_adamw8bit,bnb_lion8bit
ROWS+=,pgs_lion8bit_gather,pgs_adamw8bit_gather,pgs_lion8bit_gather_dec,pgs_adamw8bit_gather_dec
ROWS+=,pgs_lion8bit_gather_rows16,pgs_lion8bit_gather_warps8,pgs_lion8bit_gather_rows16_warps8
ROWS+=,pgs_adamw8bit_gather_rows8,pgs_lion8bit_repeat,pgs_adamw8bit_repeat
LEFT=$((LIMIT - SECONDS - 2))
if [ "$LEFT" -lt 25 ]; then
  log "only ${LEFT} s left: bench skipped"
else
  BUDGET=$((LEFT - 25))  # rows not started by then are recorded as skipped
  log "bench: ${LEFT} s (rows start until ${BUDGET} s)"
  set -o pipefail
  timeout -k 3 "$LEFT" "$PY" bench/optim_8bit.py "$OUT/optim_8bit.json" --only "$ROWS" --budget "$BUDGET" \
    --iters 10 $BENCH_ARGS 2>&1 | grep -v -i "warning" | cut -c1-300 >> "$LOG"
  rc=$?
  set +o pipefail
  log "bench: exit $rc"
  [ -f "$OUT/optim_8bit.json" ] || log "bench wrote no JSON"
  rm -f "$OUT"/optim_8bit.json.*.tmp  # an isolated row's leftover, if any (keeps $OUT at 3 files)
fi
"$PY" - "$OUT/optim_8bit.json" >> "$LOG" 2>&1 <<'EOF' || log "summary failed"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for k, v in rows.items():
    print(f"{k:36s}", f"{v['ms']:8.2f} ms  {v['fraction_of_copy_bw']:.3f} of copy bw" if "ms" in v
          else str(v.get("error") or v.get("skipped"))[:120])
EOF
log "done in ${SECONDS} s; files: $(ls "$OUT" | tr '\n' ' ')"
