. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/tr; S=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_delta.py tests/test_gpu.py -k "streams or delta or word or fanout" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log; grep -E "FAILED|Error" $R/gpu_tests.log | head -5
timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/s1.json > $R/s1.log 2>&1; echo "s1 rc $? at $(( $(date +%s) - S )) s"
timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 4 --buffer-mb 2048 --modes words --trace $R/tr --out $R/t.json > $R/t.log 2>&1; echo "trace rc $? at $(( $(date +%s) - S )) s"
for m in words auto; do python3 -m bench.trace_summary $R/tr/trace_${m}_0.json $R/tr/trace_${m}_1.json --ops 20 > $R/${m}_ops.txt 2>&1; done
gzip -c $R/tr/trace_auto_1.json > $R/trace_auto_1.json.gz; gzip -c $R/tr/trace_auto_0.json > $R/trace_auto_0.json.gz; rm -rf $R/tr; ls -la $R
(cd $R && tar czf $OUT/all.tgz .)
grep -A4 "^S1 over" $R/s1.log | tail -4 | cut -c1-122
