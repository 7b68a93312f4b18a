#!/bin/bash
# One device call for the checksums (issue 18), one GPU: the checksum tests, the colocated IPC GPU tests,
# the kernel's throughput in a few shapes (bench.checksum_kernels), then S2 (refit, refit_checksums, floor) three
# times with the shape that did one fused pass plus one sum fastest.
# Run from the checkout root; results under $OUT (default /tmp/out): log.txt, kernels.json, s2_{1,2,3}.json.
set -o pipefail
. bench/gpu_env.sh
{
  python -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  timeout 200 python -m pytest -q -x tests/test_checksum.py tests/test_gpu_checksum.py 2>&1 | tail -15
  timeout 200 python -m pytest -q tests/test_gpu.py -k colocated 2>&1 | tail -6
  timeout 150 python -m bench.checksum_kernels --gib "${GIB:-4}" --out "$OUT/kernels.json" 2>&1 | grep -v '^ \|^{\|^}'
  BEST=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['best'])" "$OUT/kernels.json" 2>/dev/null)
  echo "kernel shape (block,steps,warps) for S2: ${BEST:-the default}"
  for i in ${RUNS:-1 2 3}; do
    REFIT_SUM_KERNEL=$BEST timeout 170 python -m refit.tools.cli bench --scenarios S2 --growth-iters 10 --iters 10 \
      --out "$OUT/s2_$i.json" 2>&1 | grep -E "median|Error|error|FAIL"
  done
} 2>&1 | tee "$OUT/log.txt"
