. bench/gpu_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 200 python3 -m refit.tools.cli bench --scenarios S1,S2,S3 --growth-iters 3 --iters 10 --out $R/bench.json > $R/bench.log 2>&1; echo "bench rc $? at $(( $(date +%s) - S )) s"
timeout 340 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_checksum.py > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log
echo "warnings (leaked shared_memory / Producer process / resource_tracker), bench and tests:"; grep -c -i -E "leaked shared_memory|Producer process has been terminated|resource_tracker" $R/bench.log $R/gpu_tests.log
(cd $R && tar czf $OUT/all.tgz .)
grep -E "^\s+[a-z_0-9]+ +median" $R/bench.log
