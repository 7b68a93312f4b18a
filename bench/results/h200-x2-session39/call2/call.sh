. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_delta.py tests/test_gpu.py -k "delta or word or fanout or fp8 or megatron or peer or paced" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -2 $R/gpu_tests.log
timeout 200 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/delta.json > $R/delta.log 2>&1; echo "delta rc $? at $(( $(date +%s) - S )) s"
timeout 150 python3 -m bench.delta_gpu --s3 --no-s1 --no-kernels --iters 4 --out $R/delta_s3.json > $R/delta_s3.log 2>&1; echo "s3 rc $? at $(( $(date +%s) - S )) s"
(cd $R && tar czf $OUT/all.tgz .)
tail -25 $R/delta.log; tail -15 $R/delta_s3.log
