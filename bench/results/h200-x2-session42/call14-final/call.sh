. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_delta.py tests/test_gpu.py -k "streams or delta or word or fanout" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log; grep -E "FAILED|Error" $R/gpu_tests.log | head -5
for t in final1 final2 final3 final4 final5; do
  timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/$t.json > $R/$t.log 2>&1; echo "$t rc $? at $(( $(date +%s) - S )) s"; done
(cd $R && tar czf $OUT/all.tgz .)
for t in final1 final2 final3 final4 final5; do echo "== $t"; grep -A4 "^S1 over" $R/$t.log | tail -4 | cut -c1-122; done
