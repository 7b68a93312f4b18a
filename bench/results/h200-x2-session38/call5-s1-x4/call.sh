. bench/gpu_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
for i in 1 2 3 4; do timeout 60 python3 -m refit.tools.cli bench --scenarios S1 --methods refit,refit_checksums --growth-iters 3 --iters 10 --out $R/s1_$i.json > $R/s1_$i.log 2>&1; echo "s1_$i rc $? at $(( $(date +%s) - S )) s"; grep -E "^\s+[a-z_0-9]+ +median" $R/s1_$i.log; done
(cd $R && tar czf $OUT/all.tgz .)
