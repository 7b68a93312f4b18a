#!/bin/bash
# One device call on 2 GPUs (nvidia-h100-x2) for issue 18: every GPU test (2-GPU ones included), then
# S1, S2, S3 (refit, refit_checksums, floor and the peers) RUNS times. The GPU image lacks `cryptography`:
# carry its wheels in .whl/ (device tool carry [".whl"]). Results under $OUT: tests.txt, bench_<i>.json/.txt,
# warnings.txt. Env knobs: SKIP_TESTS=1, RUNS (default "1"), SCEN (default S1,S2,S3), BENCH_ARGS.
set -o pipefail
. bench/gpu_env.sh
nvidia-smi topo -m | head -4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ -z "$SKIP_TESTS" ]; then
  SECONDS=0
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -s -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_checksum.py \
    > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? in ${SECONDS}s"; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3
fi
for i in ${RUNS-1}; do
  SECONDS=0
  timeout ${BENCH_TIMEOUT:-330} python3 -m refit.tools.cli bench --scenarios ${SCEN:-S1,S2,S3} --growth-iters 3 --iters 10 \
    ${BENCH_ARGS:-} --out "$OUT/bench_$i.json" > "$OUT/bench_$i.txt" 2>&1
  echo "bench run $i rc=$? in ${SECONDS}s"; grep -E "refit|floor" "$OUT/bench_$i.txt" | tail -14
done
grep -h -i -E "terminated before all shared CUDA|leaked shared_memory|resource_tracker" "$OUT"/*.txt > "$OUT/warnings.txt"
echo "shared-memory / CUDA-IPC warnings: $(wc -l < "$OUT/warnings.txt")"
