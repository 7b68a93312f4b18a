. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/tr; S=$(date +%s)
timeout 150 python3 -m bench.delta_gpu --no-kernels --iters 4 --buffer-mb 2048 --modes words --trace $R/tr --out $R/t.json > $R/t.log 2>&1; echo "trace rc $? at $(( $(date +%s) - S )) s"
python3 -m bench.trace_summary $R/tr/trace_words_0.json $R/tr/trace_words_1.json > $R/words_summary.txt 2>&1
gzip -9 $R/tr/*.json; ls -la $R/tr
(cd $R && tar cf $OUT/all.tar .)
grep -A4 "^S1 over" $R/t.log | cut -c1-100; head -60 $R/words_summary.txt
