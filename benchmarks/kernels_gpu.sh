#!/usr/bin/env bash
# Every GPU check of the Triton kernels in one run: the kernel and engine tests on CUDA (split over
# parallel processes), the launch-shape sweep (its variants compiled in parallel first), then the
# attention benchmark with the sweep's fastest shapes (its table printed last; NO_SWEEP=1: with the
# default shapes). Logs and the benchmark's JSON go to $OUT.
#   OUT=out bash benchmarks/kernels_gpu.sh [benchmarks/attention_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's kvstrata, installed or not
PY=${PYTHON:-python3}
JOBS=${JOBS:-6}
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
  | tee "$OUT/versions.txt"
TESTS=${TESTS:-tests/radix/test_kernels_attend.py tests/radix/test_kernels_page_quantize.py tests/engine/test_engine_triton.py}
# shellcheck disable=SC2086
$PY -m pytest -q --collect-only -p no:cacheprovider $TESTS 2>/dev/null | grep "::" >"$OUT/test_ids.txt"
split -n "r/$JOBS" -d "$OUT/test_ids.txt" "$OUT/tests_part"
for part in "$OUT"/tests_part*; do
  timeout "${TEST_TIMEOUT:-300}" xargs -d '\n' -a "$part" $PY -m pytest -q -p no:cacheprovider >"$part.log" 2>&1 &
done
if [ -z "${NO_SWEEP:-}" ]; then
  n=$($PY benchmarks/attention_sweep.py --count)
  seq 0 $((n - 1)) | xargs -P "$JOBS" -I{} $PY benchmarks/attention_sweep.py --warm {} >"$OUT/warm.log" 2>&1
  echo "warm exit $?"
fi
wait
cat "$OUT"/tests_part*.log >"$OUT/tests.log"
echo "tests: $(cat "$OUT"/tests_part*.log | grep -cE "^(FAILED|ERROR)") failed of $(wc -l <"$OUT/test_ids.txt")"
grep -hE "[0-9]+ (passed|failed)" "$OUT"/tests_part*.log
grep -hE "^(FAILED|ERROR)" "$OUT"/tests_part*.log | head -20
if [ -z "${NO_SWEEP:-}" ]; then
  # The sweep's table, then the benchmark run with the fastest shapes it found.
  $PY benchmarks/attention_sweep.py --then-bench --out "$OUT/attention_gpu.json" "$@" 2>&1 \
    | tee "$OUT/bench.log" | grep -vE '^(  |\{)'
else
  $PY benchmarks/attention_gpu.py --out "$OUT/attention_gpu.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
fi
