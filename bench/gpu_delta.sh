#!/usr/bin/env bash
# Delta refits on the GPU machine (1 or 2 GPUs; torch, transformers and Triton are there, nothing to carry):
# kernel timings at 0.1/1/10/100% changed on llama-3.1-8b shapes, the rule's choice (S2 picks dense), and
# with 2 GPUs S1 dense vs delta over NCCL. Results: $OUT/delta.json, the table in $OUT/delta.txt.
. bench/gpu_env.sh
# the kernel against the torch path on CUDA (pytest and hypothesis from .wheels/, as bench/gpu_run.sh carries them)
[ -d .wheels ] && pip install -q --no-index --no-deps .wheels/*.whl 2>&1 | tail -1 && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_delta.py -k cuda 2>&1 | tail -3
timeout ${DELTA_TIMEOUT:-540} python3 -m bench.delta_gpu ${DELTA_ARGS:-} --out "$OUT/delta.json" 2>&1 | tee "$OUT/delta.txt" | tail -40
