. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 120 python3 -m refit.tools.cli bench --scenarios S1,S2,S3 --methods refit,refit_checksums --iters 10 --growth-iters 3 --out $R/head.json > $R/head.log 2>&1; echo "bench rc $? at $(( $(date +%s) - S )) s"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_gpu_checksum.py tests/test_gpu.py -k "streams or checksum or colocated or nccl" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_delta.py tests/test_gpu.py -k "delta or word or fanout_over" > $R/gpu_tests2.log 2>&1; echo "tests2 rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests2.log
(cd $R && tar czf $OUT/all.tgz .)
grep -E "^\s+[a-z_0-9]+ +median" $R/head.log; grep -E "FAILED|Error" $R/gpu_tests*.log | head -5
