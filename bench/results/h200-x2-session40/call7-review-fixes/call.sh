. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_delta.py tests/test_gpu.py -k "streams or delta or word or fanout_over" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log
(cd $R && tar czf $OUT/all.tgz .)
grep -E "FAILED|Error" $R/gpu_tests.log | head -5
