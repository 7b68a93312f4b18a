. bench/gpu_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
run() { # dir label
  d=$1; l=$2
  (cd $d && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 170 python3 -m refit.tools.cli bench --scenarios S2,S3 --methods refit,refit_checksums --iters 10 --growth-iters 3 --out $R/$l.json > $R/$l.log 2>&1; echo "$l rc $? at $(( $(date +%s) - S )) s")
}
run . newA
run .mid midA
run .base baseA
run . newB
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_checksum.py tests/test_gpu.py -k "checksum or colocated" > $R/gpu_tests.log 2>&1; tail -1 $R/gpu_tests.log; echo "tests at $(( $(date +%s) - S )) s"
(cd $R && tar czf $OUT/all.tgz .)
for f in newA midA baseA newB; do echo "== $f"; grep -E "^\s+(refit|refit_checksums|floor) " $R/$f.log; done
