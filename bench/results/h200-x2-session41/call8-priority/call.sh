. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/tr; S=$(date +%s)
run() { # $1 tag, $2 dir
  (cd $2 && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb 2048 --modes words --out $R/$1.json > $R/$1.log 2>&1); echo "$1 rc $? at $(( $(date +%s) - S )) s"; }
run new1 $PWD; run base1 $PWD/.base; run mid1 $PWD/.mid; run new2 $PWD; run base2 $PWD/.base; run mid2 $PWD/.mid
timeout 120 python3 -m bench.delta_gpu --no-kernels --iters 4 --buffer-mb 2048 --modes words --trace $R/tr --out $R/t.json > $R/t.log 2>&1; echo "trace rc $? at $(( $(date +%s) - S )) s"
python3 -m bench.trace_summary $R/tr/trace_words_0.json $R/tr/trace_words_1.json > $R/words_summary.txt 2>&1; rm -rf $R/tr
(cd $R && tar czf $OUT/all.tgz .)
for t in new1 base1 mid1 new2 base2 mid2; do echo "== $t"; grep -A4 "^S1 over" $R/$t.log | tail -4 | cut -c1-110; done
sed -n 1,40p $R/words_summary.txt
