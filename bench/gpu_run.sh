#!/usr/bin/env bash
# One device call: GPU tests, a NCCL demo, the full bench. Results under $OUT.
# The GPU machine has torch/transformers but not rich, pytest or hypothesis and
# cannot download: carry them as wheels in .wheels/ (git-ignored), made here with
#   mkdir -p .wheels && cd .wheels && pip download --no-deps rich markdown-it-py mdurl pygments \
#     pytest pluggy iniconfig pytest-timeout sortedcontainers attrs && \
#   pip download --no-deps --python-version 3.12 --only-binary=:all: hypothesis
# and run through the device tool with carry [".wheels"]. Env knobs: SKIP_TESTS=1,
# REFIT_BENCH_PROFILE=1 (per-lane IPC copy profile), BENCH_ARGS="--scenarios S3 ...",
# SKIP_CE=1 (no checkpoint-engine run), BENCH2_ARGS (a second bench, to bench2.json), BENCH_TIMEOUT. checkpoint-engine and its imports are carried in
# .wheels/ce/ (made with: cd .wheels/ce && pip download --no-deps --python-version 3.12
#   --only-binary=:all: checkpoint-engine==0.4.2 fastapi==0.115.12 starlette==0.46.2 httpx httpcore
#   anyio sniffio h11 idna certifi pydantic pydantic-core annotated-types typing-inspection
#   typing-extensions loguru pyzmq) and installed into a separate folder so they shadow nothing.
pip install -q --no-index --no-deps .wheels/*.whl 2>&1 | tail -2
. bench/gpu_env.sh
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
[ -z "$SKIP_TESTS" ] && echo "== gpu tests" && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
[ -z "$SKIP_TESTS" ] && echo "== demo (nccl)" && timeout 90 python3 -m refit.tools.cli demo --src tp=1 --dst tp=1 --steps 2 2>&1 | tail -4
echo "== bench"; timeout ${BENCH_TIMEOUT:-420} python3 -m refit.tools.cli bench ${BENCH_ARGS:-} --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
if [ -n "$BENCH2_ARGS" ]; then  # a second matrix in the same call (e.g. the FP8 variant)
  echo "== bench 2"; timeout ${BENCH_TIMEOUT:-420} python3 -m refit.tools.cli bench $BENCH2_ARGS --out "$OUT/bench2.json" > "$OUT/bench2.txt" 2>&1
  echo "bench 2 rc=$?"; tail -20 "$OUT/bench2.txt"
fi
if [ -z "$SKIP_CE" ] && [ -d .wheels/ce ]; then
  echo "== checkpoint-engine (S2)"
  pip install -q --no-index --no-deps --target /tmp/ce_site .wheels/ce/*.whl 2>&1 | tail -2
  PYTHONPATH=/tmp/ce_site:$PYTHONPATH timeout 300 python3 -m bench.checkpoint_engine_s2 --out "$OUT/checkpoint-engine.json" > "$OUT/checkpoint-engine.txt" 2>&1
  echo "checkpoint-engine rc=$?"; tail -8 "$OUT/checkpoint-engine.txt"
fi
grep -E "profile|Error|error" "$OUT/bench.txt" | head -20; tail -45 "$OUT/bench.txt"
