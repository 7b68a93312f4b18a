. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R/prof; S=$(date +%s)
timeout 150 python3 -m bench.delta_gpu --no-kernels --iters 3 --buffer-mb 2048 --modes words --profile $R/prof --out $R/p.json > $R/p.log 2>&1; echo "prof rc $? at $(( $(date +%s) - S )) s"
(cd $R && tar cf $OUT/all.tar .)
grep -A3 "^S1 over" $R/p.log | cut -c1-100; head -45 $R/prof/profile_0.txt | tail -38
