. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
for d in .base .; do (cd $d && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 50 python3 -m refit.tools.cli bench --scenarios S1 --methods refit,refit_checksums --growth-iters 3 --iters 10 --out $R/s1.json > $R/s1_${d#.}.log 2>&1; echo "$d rc $? at $(( $(date +%s) - S )) s"; grep -E "^\s+[a-z_0-9]+ +median" $R/s1_${d#.}.log); done
