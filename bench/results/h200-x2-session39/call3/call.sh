. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/prof; S=$(date +%s)
timeout 150 python3 -m bench.delta_gpu --s3 --no-s1 --no-kernels --iters 4 --out $R/delta_s3.json > $R/delta_s3.log 2>&1; echo "s3 rc $? at $(( $(date +%s) - S )) s"
timeout 120 python3 -m bench.delta_gpu --no-kernels --iters 4 --buffer-mb 2048 --modes words --profile $R/prof --out $R/delta_prof.json > $R/delta_prof.log 2>&1; echo "prof rc $? at $(( $(date +%s) - S )) s"
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=0 tests/test_delta.py tests/test_gpu.py -k "delta or word or fanout or fp8 or megatron or peer or paced" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; grep -E "passed|failed" $R/gpu_tests.log | tail -2
(cd $R && tar czf $OUT/all.tgz .)
tail -8 $R/delta_s3.log; grep -A3 "S1 over" $R/delta_prof.log; head -30 $R/prof/profile_0.txt
