. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 100 python3 -m bench.delta_gpu --s3 --no-s1 --no-kernels --iters 6 --out $R/delta_s3.json > $R/delta_s3.log 2>&1; echo "s3 rc $? at $(( $(date +%s) - S )) s"
for mb in 2048 4096; do timeout 150 python3 -m bench.delta_gpu --no-kernels --iters 10 --buffer-mb $mb --modes words --out $R/delta_$mb.json > $R/delta_$mb.log 2>&1; echo "s1 $mb rc $? at $(( $(date +%s) - S )) s"; done
(cd $R && tar czf $OUT/all.tgz .)
grep -A5 "^S3" $R/delta_s3.log; for mb in 2048 4096; do echo "== $mb"; grep -A4 "^S1 over" $R/delta_$mb.log | cut -c1-120; grep "extra memory" $R/delta_$mb.log; done
