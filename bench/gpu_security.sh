#!/bin/bash
# One device call for issue 18 on one GPU: every GPU test that fits (IPC colocated, checksums, the secure
# IPC handle test), with the children's stderr kept so shared-memory / CUDA-IPC warnings can be counted,
# then S2 (refit, refit_checksums, floor) three times. The GPU image lacks `cryptography`: carry its wheels
# in .whl/ (cryptography, cffi, pycparser for cp312) and name .whl in the device tool's carry.
# Results under $OUT: tests.txt, warnings.txt, s2_{1,2,3}.json/.txt. SKIP_TESTS=1: bench only; RUNS="": tests only.
set -o pipefail
. bench/gpu_env.sh
python3 -c "import torch, triton, cryptography; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -z "$SKIP_TESTS" ] && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -s -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_checksum.py \
  tests/test_security.py tests/test_checksum.py -k "not stranger" > "$OUT/tests.txt" 2>&1
[ -z "$SKIP_TESTS" ] && { echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3; }
for i in ${RUNS-1 2 3}; do
  timeout 170 python3 -m refit.tools.cli bench --scenarios S2 --growth-iters 10 --iters 10 --out "$OUT/s2_$i.json" \
    > "$OUT/s2_$i.txt" 2>&1
  echo "S2 run $i rc=$?"; grep -E "refit|floor" "$OUT/s2_$i.txt" | tail -4
done
grep -h -i -E "terminated before all shared CUDA|leaked shared_memory|resource_tracker" "$OUT"/*.txt > "$OUT/warnings.txt"
echo "shared-memory / CUDA-IPC warnings: $(wc -l < "$OUT/warnings.txt")"
