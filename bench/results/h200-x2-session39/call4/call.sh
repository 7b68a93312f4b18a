. bench/gpu_env.sh >/dev/null 2>&1
R=/tmp/res; rm -rf $R; mkdir -p $R; S=$(date +%s)
cd .mid; export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S3CFGS='{"dense": {}, "delta": {}}' timeout 100 python3 -m bench.delta_gpu --s3 --no-s1 --no-kernels --iters 4 --out $R/twodense.json > $R/twodense.log 2>&1; echo "A rc $? at $(( $(date +%s) - S )) s"
S3CFGS='{"delta": {"delta": "auto"}, "dense": {}}' timeout 100 python3 -m bench.delta_gpu --s3 --no-s1 --no-kernels --iters 4 --out $R/deltafirst.json > $R/deltafirst.log 2>&1; echo "B rc $? at $(( $(date +%s) - S )) s"
(cd $R && tar czf $OUT/all.tgz .)
for f in twodense deltafirst; do echo == $f; grep -A5 "^S3" $R/$f.log; tail -3 $R/$f.log; done
