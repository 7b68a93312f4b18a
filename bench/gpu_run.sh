#!/usr/bin/env bash
# The GPU runner behind docs/benchmarks.md: one call on a GPU machine, the parts named by PARTS (space-separated;
# default "tests bench"), results under $OUT (default /tmp/out) and a summary printed last.
#   tests    the GPU tests: pytest -m gpu $TESTS (default tests/test_gpu.py tests/test_gpu_checksum.py) [-k $TEST_K]
#   bench    refit bench $BENCH_ARGS (e.g. "--scenarios S1,S2,S3 --iters 10 --growth-iters 3") -> bench.json
#   fp8      refit bench --fp8 $FP8_ARGS (default "--scenarios S2 --iters 10 --growth-iters 10") -> fp8.json
#   quant    refit bench --fp8 --quant mxfp8,nvfp4 $QUANT_ARGS (default "--scenarios S2 --iters 5 --growth-iters 5")
#            -> quant.json (block FP8, MXFP8 and NVFP4 engines in one run, each beside floor_read_copy)
#   ce       checkpoint-engine on S2 (bench.checkpoint_engine_s2) -> checkpoint-engine.json; needs .wheels/ce
#   overlap  bench.overlap_gpu per $OVERLAP_RUNS ("S2:600 S1:-": scenario:pull GB/s, "-" full speed)
#   delta    bench.delta_gpu $DELTA_ARGS (default "--no-kernels --iters 4 --buffer-mb 2048 --modes words --s2-nixl":
#            S1 over NCCL and S2 over NIXL; --s2-nixl needs .wheels/nixl)
#   lora     bench.lora_merge --model llama-3.1-8b --ranks 16,64
#   nixl     refit bench with refit_nixl beside refit and refit_nccl, $NIXL_ARGS; needs .wheels/nixl
# The GPU machines have torch, transformers and Triton but not pytest, rich, hypothesis or cryptography, and
# cannot download: carry their wheels (git-ignored) and name them in the device tool's carry, e.g.
#   mkdir -p .wheels && cd .wheels && pip download --no-deps rich markdown-it-py mdurl pygments pytest pluggy \
#     iniconfig pytest-timeout sortedcontainers attrs && pip download --no-deps --python-version 3.12 \
#     --only-binary=:all: hypothesis cryptography cffi pycparser psutil
#   .wheels/nixl: pip download --no-deps --python-version 3.12 --only-binary=:all: nixl-cu13==1.5.1 nixl==1.5.1
#   .wheels/ce:   the same for checkpoint-engine==0.4.2 and its imports (pyzmq, loguru, pydantic, fastapi, httpx)
# Knobs: TIMEOUT (per part, seconds, default 300).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
_wheels=$(ls .wheels/*.whl .wheels/nixl/*.whl 2>/dev/null)
[ -n "$_wheels" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site $_wheels 2>&1 | grep -v WARN
export PYTHONPATH=$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
T=${TIMEOUT:-300}
SUM="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$SUM"
for part in ${PARTS:-tests bench}; do
  SECONDS=0
  case $part in
  tests)
    timeout "$T" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_gpu.py tests/test_gpu_checksum.py} \
      ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.txt" 2>&1
    echo "tests rc=$? $(tail -1 "$OUT/tests.txt")" >> "$SUM";;
  bench)
    timeout "$T" python3 -m refit.tools.cli bench ${BENCH_ARGS:-} --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
    echo "bench rc=$?" >> "$SUM"; grep -E "^\s+[a-z_0-9]+ +median" "$OUT/bench.txt" >> "$SUM";;
  fp8)
    timeout "$T" python3 -m refit.tools.cli bench --fp8 ${FP8_ARGS:---scenarios S2 --iters 10 --growth-iters 10} \
      --out "$OUT/fp8.json" > "$OUT/fp8.txt" 2>&1
    echo "fp8 rc=$?" >> "$SUM"; grep -E "^\s+[a-z_0-9]+ +median" "$OUT/fp8.txt" >> "$SUM";;
  quant)
    timeout "$T" python3 -m refit.tools.cli bench --fp8 --quant mxfp8,nvfp4 \
      ${QUANT_ARGS:---scenarios S2 --iters 5 --growth-iters 5} --out "$OUT/quant.json" > "$OUT/quant.txt" 2>&1
    echo "quant rc=$?" >> "$SUM"; grep -E "^\s+[a-z_0-9]+ +median" "$OUT/quant.txt" >> "$SUM";;
  ce)
    python3 -m pip install -q --no-index --no-deps --target /tmp/ce_site .wheels/ce/*.whl 2>&1 | grep -v WARN
    PYTHONPATH=/tmp/ce_site:$PYTHONPATH timeout "$T" python3 -m bench.checkpoint_engine_s2 \
      --out "$OUT/checkpoint-engine.json" > "$OUT/checkpoint-engine.txt" 2>&1
    echo "checkpoint-engine rc=$?" >> "$SUM"; tail -4 "$OUT/checkpoint-engine.txt" >> "$SUM";;
  overlap)
    for r in ${OVERLAP_RUNS:-S2:600 S1:-}; do
      s=${r%%:*}; g=${r#*:}; tag=$s$([ "$g" != "-" ] && echo "_pace$g")
      timeout "$T" python3 -m bench.overlap_gpu --scenario "$s" --iters 5 $([ "$g" != "-" ] && echo "--pull-gbps $g") \
        --json "$OUT/overlap_$tag.json" > "$OUT/overlap_$tag.txt" 2>&1
      echo "overlap $tag rc=$?" >> "$SUM"; tail -5 "$OUT/overlap_$tag.txt" >> "$SUM"
    done;;
  delta)
    timeout "$T" python3 -m bench.delta_gpu ${DELTA_ARGS:---no-kernels --iters 4 --buffer-mb 2048 --modes words --s2-nixl} \
      --out "$OUT/delta.json" > "$OUT/delta.txt" 2>&1
    echo "delta rc=$?" >> "$SUM"; tail -12 "$OUT/delta.txt" >> "$SUM";;
  lora)
    timeout "$T" python3 -m bench.lora_merge --model llama-3.1-8b --ranks 16,64 --out "$OUT/lora_merge.json" \
      > "$OUT/lora_merge.txt" 2>&1
    echo "lora rc=$?" >> "$SUM"; tail -4 "$OUT/lora_merge.txt" >> "$SUM";;
  nixl)
    REFIT_BENCH_NIXL=1 timeout "$T" python3 -m refit.tools.cli bench \
      ${NIXL_ARGS:---scenarios S1,S2,S3 --methods refit,refit_nccl,refit_nixl --iters 7 --growth-iters 3} \
      --out "$OUT/nixl.json" > "$OUT/nixl.txt" 2>&1
    echo "nixl rc=$?" >> "$SUM"; grep -E "^\s+[a-z_0-9]+ +median" "$OUT/nixl.txt" >> "$SUM";;
  *) echo "unknown part $part (tests bench fp8 quant ce overlap delta lora nixl)" >> "$SUM";;
  esac
  echo "[$part: ${SECONDS}s]" >> "$SUM"
done
cat "$SUM"
