# Sourced by bench/device.sh and bench/device_product.sh (run from the repo root with ".whl" carried):
# installs the carried wheels into /tmp/site (again when new ones are carried), sets PYTHONPATH, OUT and T0, and defines
# left N (seconds left of a budget of N) and log MSG (a timestamped line in $OUT/all.log).
# (a warm machine keeps /tmp/site between calls: wheels carried since the last install, e.g. the
# TRL ones copied in for one suite, are installed then; /tmp/site/.wheels lists what is in)
if [ -d .whl ]; then
  mkdir -p /tmp/site
  for w in .whl/*.whl; do
    grep -qxF "$(basename "$w")" /tmp/site/.wheels 2>/dev/null && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    ls .whl | grep '\.whl$' > /tmp/site/.wheels
    break
  done
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
log() { echo "=== $* ($(( $(date +%s) - T0 )) s)" >> "$OUT/all.log"; }
# log_tail N: the last N lines of $OUT/all.log without warnings, tracebacks' frames, dynamo and
# glog noise, cut at 200 characters (what a device script prints at its end).
log_tail() {
  grep -v -i "warn\|^ *$\|This call\|  File \|dynamo\|USDT\|^W1[0-9]" "$OUT/all.log" | cut -c1-200 | tail -"$1"
}
# cuda_tests SECONDS [--tb=STYLE] PYTEST_ARGS...: run pytest within SECONDS, keeping each test's
# outcome line, its failure lines and the summary in $OUT/pytest.log (and a line saying so when the
# timeout cut it off: the tests that ended before it are still listed).
cuda_tests() {
  local secs=$1; shift
  timeout "$secs" python3 -m pytest -v -p no:cacheprovider "$@" > "$OUT/pytest.full" 2>&1
  local rc=$?
  grep -v "^W1[0-9]" "$OUT/pytest.full" | grep -E "PASSED|FAILED|ERROR|SKIPPED|Error|assert|passed|failed" \
    | cut -c1-400 | head -80 > "$OUT/pytest.log"
  [ "$rc" = 124 ] && echo "pytest: cut off by the ${secs} s timeout (no summary)" >> "$OUT/pytest.log"
  rm -f "$OUT/pytest.full"
}
