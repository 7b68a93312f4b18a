#!/bin/bash
# One device call, several parts chosen by PARTS (space-separated; default "tests overlap lora"):
#   tests    GPU tests: $TESTS (default test_gpu_checksum.py and test_gpu.py -k $TEST_K), one file at a time, -v
#   overlap  bench/overlap_gpu.py S2 (and S1 with 2 GPUs): stall while refit stages, beside stop-the-world;
#            $OVERLAP_RUNS picks runs as "S2:- S2:500 S1:-" (scenario:pull GB/s, "-" full speed)
#   lora     bench/lora_merge.py: adapter vs merged refit bytes, merge time
#   delta    bench/delta_gpu.py (bench/gpu_delta.sh's command)
#   find     bench/delta_find_variants.py: the delta find kernel's variants on GPU 0 ($FIND_ARGS)
#   nixl     refit bench with refit_nixl (REFIT_NIXL_DEBUG=1): $NIXL_SCEN (default S1,S2), $NIXL_ARGS
# Carry [".whl", ".wheels"] (cryptography etc. in .whl; nixl-cu13 in .wheels/nixl). Results under $OUT; a short
# summary last.
set -o pipefail
. bench/gpu_env.sh
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "gpus $NG"
SUM="$OUT/summary.txt"; : > "$SUM"
for part in ${PARTS:-tests overlap lora}; do
  SECONDS=0
  case $part in
  tests)
    for f in ${TESTS:-tests/test_gpu_checksum.py tests/test_gpu.py}; do
      b=$(basename $f .py); k=""; [ "$b" = test_gpu ] && [ -n "$TEST_K" ] && k="$TEST_K"
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider $f ${k:+-k "$k"} > "$OUT/$b.txt" 2>&1
      echo "$f rc=$? $(grep -E '^=+ .*(passed|failed)' "$OUT/$b.txt" | tail -1)" >> "$SUM"
      grep -E "FAILED|ERROR" "$OUT/$b.txt" | head -5 >> "$SUM"
    done
    echo "shm/IPC warnings: $(grep -h -i -E 'terminated before all shared CUDA|leaked shared_memory|leaked semaphore' "$OUT"/test_*.txt | wc -l)" >> "$SUM";;
  overlap)
    # OVERLAP_RUNS: "scenario:pull_gbps" pairs (pull_gbps "-": full speed); default S2 and, with 2 GPUs, S1
    for r in ${OVERLAP_RUNS:-S2:- $([ "$NG" -ge 2 ] && echo S1:-)}; do
      s=${r%%:*}; case $r in *:*) g=${r#*:};; *) g=-;; esac; tag=$s$([ "$g" != "-" ] && echo "_pace$g")
      timeout ${OVERLAP_TIMEOUT:-200} python3 -m bench.overlap_gpu --scenario $s --iters ${OVERLAP_ITERS:-5} \
        $([ "$g" != "-" ] && echo "--pull-gbps $g") --json "$OUT/overlap_$tag.json" > "$OUT/overlap_$tag.txt" 2>&1
      echo "overlap $tag rc=$?" >> "$SUM"; tail -5 "$OUT/overlap_$tag.txt" >> "$SUM"
    done;;
  lora)
    timeout 150 python3 -m bench.lora_merge --model llama-3.1-8b --ranks 16,64 --out "$OUT/lora_merge.json" > "$OUT/lora_merge.txt" 2>&1
    echo "lora rc=$?" >> "$SUM"; tail -8 "$OUT/lora_merge.txt" >> "$SUM";;
  delta)
    timeout ${DELTA_TIMEOUT:-300} python3 -m bench.delta_gpu ${DELTA_ARGS:-} --out "$OUT/delta.json" > "$OUT/delta.txt" 2>&1
    echo "delta rc=$?" >> "$SUM"; tail -30 "$OUT/delta.txt" >> "$SUM";;
  find)
    timeout ${FIND_TIMEOUT:-200} python3 -m bench.delta_find_variants ${FIND_ARGS:---gib 8} --out "$OUT/find.json" > "$OUT/find.txt" 2>&1
    echo "find rc=$?" >> "$SUM"; cat "$OUT/find.txt" >> "$SUM";;
  nixl)
    REFIT_BENCH_NIXL=1 REFIT_NIXL_DEBUG=1 timeout ${NIXL_TIMEOUT:-200} python3 -m refit.tools.cli bench \
      --scenarios ${NIXL_SCEN:-S1,S2} ${NIXL_ARGS:---iters 5 --growth-iters 3} --out "$OUT/nixl.json" > "$OUT/nixl.txt" 2>&1
    echo "nixl rc=$?" >> "$SUM"; grep -E "^  (refit|floor)|rror" "$OUT/nixl.txt" | cut -c1-160 | tail -14 >> "$SUM";;
  esac
  echo "[$part: ${SECONDS}s]" >> "$SUM"
done
cat "$SUM"
