# Sourced by the bench/gpu_*.sh device scripts (run from the repo root with ".whl" carried):
# installs the carried wheels into /tmp/site once, sets PYTHONPATH, OUT and T0, and defines
# left N (seconds left of a budget of N) and log MSG (a timestamped line in $OUT/all.log).
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
log() { echo "=== $* ($(( $(date +%s) - T0 )) s)" >> "$OUT/all.log"; }
