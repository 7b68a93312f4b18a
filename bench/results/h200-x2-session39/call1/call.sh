. bench/gpu_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
timeout 200 python3 -m refit.tools.cli bench --scenarios S1,S2,S3 --methods refit,refit_checksums --iters 10 --growth-iters 3 --out $R/head.json > $R/head.log 2>&1; echo "head rc $? at $(( $(date +%s) - S )) s"
(cd .base && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 70 python3 -m refit.tools.cli bench --scenarios S1 --methods refit,refit_checksums --iters 10 --growth-iters 3 --out $R/base_s1.json > $R/base_s1.log 2>&1; echo "base rc $? at $(( $(date +%s) - S )) s")
timeout 210 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_checksum.py tests/test_gpu.py -k "checksum or colocated or nccl" > $R/gpu_tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - S )) s"; tail -3 $R/gpu_tests.log
(cd $R && tar czf $OUT/all.tgz .)
for f in head base_s1; do echo "== $f"; grep -E "^\s+[a-z_0-9]+ +median|^S[0-9]|scenario" $R/$f.log; done
