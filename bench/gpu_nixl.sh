#!/usr/bin/env bash
# One device call: S1 and S2 (S3 too when two GPUs are lent: BENCH_SCENARIOS=S1,S2,S3) over NIXL beside
# refit's IPC path ("refit") and NCCL P2P ("refit_nccl", S1) in the same processes. Results under $OUT.
# The GPU machines run torch cu130: carry the nixl-cu13 wheel (56 MiB; 28 MiB after
# `zip -d <wheel> 'nixl_ep_cu13/*' 'nixl_cu13.libs/ucx/libucx_perftest_cuda*'`, builds refit does not load) and the
# nixl meta package in .wheels/nixl/ (git-ignored), made here with
#   mkdir -p .wheels/nixl && cd .wheels/nixl && pip download --no-deps --python-version 3.12 \
#     --only-binary=:all: nixl-cu13==1.5.1 nixl==1.5.1
# and run through the device tool with carry [".wheels"] (plus rich etc. as bench/gpu_run.sh says):
#   bash bench/gpu_nixl.sh
# Env knobs: BENCH_SCENARIOS (default S1,S2), BENCH_ARGS (extra refit bench flags, e.g. "--model tiny-llama
# --iters 3 --growth-iters 3 --deadline-s 60" for a first, short run), BENCH_TIMEOUT,
# REFIT_NIC_MODE (auto/stripe/off: which NICs UCX may use; one host needs none: UCX takes cuda_ipc / NVLink),
# REFIT_NIXL_DEBUG (default 1 here: a line per NIXL phase, UCX's transport and protocol choices; 0: quiet).
export REFIT_BENCH_NIXL=1  # refit_nixl on GPUs runs only when asked for
export REFIT_NIXL_DEBUG=${REFIT_NIXL_DEBUG:-1}
# into a folder of their own (--no-deps: keep the machine's cu130 torch); a plain `pip install` into the image's
# Python failed there (nothing installed, not even cryptography)
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl 2>&1 | grep -v WARN
fi
. bench/gpu_env.sh
python3 -c "import torch, nixl._api; print('torch', torch.__version__, 'nixl ok, gpus', torch.cuda.device_count())" \
  || { echo "nixl does not import here: no NIXL rows"; exit 2; }
echo "== bench (NIXL beside IPC and NCCL)"
timeout ${BENCH_TIMEOUT:-500} python3 -m refit.tools.cli bench --scenarios ${BENCH_SCENARIOS:-S1,S2} ${BENCH_ARGS:-} \
  --out "$OUT/bench-nixl.json" > "$OUT/bench-nixl.txt" 2>&1
echo "bench rc=$?"; grep -E "Error|error" "$OUT/bench-nixl.txt" | head -20
echo "== UCX: how READs into GPU memory go (cuda_ipc zero-copy is the fast path; tcp or 'emulation' is not)"
grep -A8 "remote memory read" "$OUT/bench-nixl.txt" | grep -E "read|zero-copy|copy|emul|cuda_ipc|tcp" | sort -u | head -20
echo "== the last NIXL phases of each process"
grep "refit nixl pid" "$OUT/bench-nixl.txt" | tail -40
grep -vE "refit nixl pid|UCX" "$OUT/bench-nixl.txt" | tail -30
