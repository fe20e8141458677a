#!/usr/bin/env bash
# Every GPU check of the Triton kernels in one run: the kernel and engine tests on CUDA, then the
# attention benchmark (its table printed last). Logs and the benchmark's JSON go to $OUT.
#   OUT=out bash benchmarks/kernels_gpu.sh [benchmarks/attention_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
  | tee "$OUT/versions.txt"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider --durations=5 \
  ${TESTS:-tests/radix/test_kernels_attend.py tests/radix/test_kernels_page_quantize.py tests/engine/test_engine_triton.py} \
  >"$OUT/tests.log" 2>&1
echo "tests exit $?"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
$PY benchmarks/attention_gpu.py --out "$OUT/attention_gpu.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
