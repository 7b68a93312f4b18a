. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
run() { # $1 tag, $2 dir
  (cd $2 && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/$1.json > $R/$1.log 2>&1); echo "$1 rc $? at $(( $(date +%s) - S )) s"; }
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_delta.py tests/test_gpu.py -k "streams or delta or word or fanout" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log; grep -E "FAILED|Error" $R/gpu_tests.log | head -5
run new1 $PWD; run base1 $PWD/.base; run new2 $PWD; run new3 $PWD
(cd $R && tar czf $OUT/all.tgz .)
for t in new1 base1 new2 new3; do echo "== $t"; grep -A4 "^S1 over" $R/$t.log | tail -4 | cut -c1-122; done
