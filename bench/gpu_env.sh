# Sourced by the GPU bench scripts (bench/gpu_*.sh): the results folder, the carried wheels and the environment.
# Installs what the device tool carried into /tmp/site (--no-deps: the image's torch stays): .whl/ (cryptography,
# cffi, pycparser, psutil for cp312: the image lacks them) and .wheels/nixl/ (nixl-cu13, see gpu_nixl.sh).
# Sets OUT (default /tmp/out, created), PYTHONPATH (this checkout, /tmp/site, then the caller's), NCCL without
# NVLink multicast (KINDS.md), and prints the GPU's name. Shell options stay the caller's.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
_wheels=$(ls .whl/*.whl .wheels/nixl/*.whl 2>/dev/null)
if [ -n "$_wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $_wheels 2>&1 | grep -v WARN
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1
