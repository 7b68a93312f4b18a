. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/tr; S=$(date +%s)
run() { # $1 tag, $2 dir
  (cd $2 && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/$1.json > $R/$1.log 2>&1); echo "$1 rc $? at $(( $(date +%s) - S )) s"; }
run new1 $PWD; run base1 $PWD/.base; run new2 $PWD; run base2 $PWD/.base; run new3 $PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_streams.py tests/test_delta.py tests/test_gpu.py -k "streams or delta or word or fanout" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -1 $R/gpu_tests.log; grep -E "FAILED|Error" $R/gpu_tests.log | head -5
timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 4 --buffer-mb 2048 --modes words --trace $R/tr --out $R/t.json > $R/t.log 2>&1; echo "trace rc $? at $(( $(date +%s) - S )) s"
for m in words auto; do python3 -m bench.trace_summary $R/tr/trace_${m}_0.json $R/tr/trace_${m}_1.json > $R/${m}_summary.txt 2>&1; done; rm -rf $R/tr
(cd $R && tar czf $OUT/all.tgz .)
for t in new1 base1 new2 base2 new3; do echo "== $t"; grep -A4 "^S1 over" $R/$t.log | tail -4 | cut -c1-122; done
grep -n "refit delta v10 (user" -A18 $R/auto_summary.txt | head -40
