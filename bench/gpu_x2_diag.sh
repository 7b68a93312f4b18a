#!/bin/bash
# Device call (2 GPUs): the GPU tests one file at a time with -v (which test runs long), then a NIXL smoke
# bench on tiny-llama (S1, S2) with REFIT_NIXL_DEBUG=1. Carry [".whl", ".wheels"]. Results under $OUT.
set -o pipefail
. bench/gpu_env.sh
python3 -c "import pytest_timeout" 2>/dev/null && echo "pytest-timeout present" || echo "no pytest-timeout"
for f in ${TEST_FILES-tests/test_gpu_checksum.py tests/test_gpu.py}; do
  SECONDS=0; b=$(basename $f .py)
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider $f ${TEST_K:+-k "$TEST_K"} > "$OUT/$b.txt" 2>&1
  echo "$f rc=$? in ${SECONDS}s"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/$b.txt" | cut -c1-150 | tail -20
done
grep -h -i -E "terminated before all shared CUDA|leaked shared_memory|leaked semaphore" "$OUT"/*.txt > "$OUT/warnings.txt"
echo "shared-memory / CUDA-IPC warnings: $(wc -l < "$OUT/warnings.txt")"
if [ -n "$NIXL_SCEN" ]; then
  SECONDS=0
  REFIT_BENCH_NIXL=1 REFIT_NIXL_DEBUG=1 timeout ${NIXL_TIMEOUT:-150} python3 -m refit.tools.cli bench --scenarios $NIXL_SCEN \
    ${NIXL_ARGS:---model tiny-llama --iters 5 --growth-iters 3} --out "$OUT/nixl.json" > "$OUT/nixl.txt" 2>&1
  echo "nixl bench rc=$? in ${SECONDS}s"; grep -E "refit|floor|rror" "$OUT/nixl.txt" | cut -c1-160 | tail -20
fi
