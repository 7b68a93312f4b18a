#!/usr/bin/env bash
# NIXL pulls vs gloo P2P on CPU, in the same processes and the same run: `refit bench --device cpu` S1 (1 -> 1)
# and S3 (fsdp=2 -> tp=2) on a 178 MB llama (bench/models/llama-180m, fp32), every method checked bit for bit;
# methods "refit" (transport auto: gloo P2P on one CPU host) and "refit_nixl" (NIXL READs, UCX over CMA).
# Needs the nixl extra (scripts/test.sh installs it). Records: bench/results/cpu-nixl.json.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/refit bench --device cpu --model bench/models/llama-180m --scenarios S1,S3 \
  --warmup 1 --iters 5 --growth-iters 5 --out bench/results/cpu-nixl.json "$@"
