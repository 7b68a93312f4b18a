"""P2P waits on CUDA over NCCL: called inline (``Work.wait()`` only orders the stream), unless NCCL's
blocking-wait mode makes it block the host, where a thread must hold it while the clock runs."""

from types import SimpleNamespace

import pytest

from refit.transport.clock import RunClock
from refit.transport.p2p import P2PSchedule, _nccl_blocking_wait


@pytest.mark.parametrize(
    "env,blocking",
    [
        ({}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, False),
        ({"NCCL_BLOCKING_WAIT": "true"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, False),  # the new name wins
    ],
)
def test_blocking_wait_mode_is_read_from_either_name(monkeypatch, env, blocking):
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _nccl_blocking_wait() is blocking


class _Work:
    def __init__(self, log: list, name: str, error: Exception | None = None) -> None:
        self.log, self.name, self.error = log, name, error

    def wait(self) -> None:
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


def _op(peer: int):
    return SimpleNamespace(peer=peer, what=lambda: f"message to or from {peer}")


def test_inline_waits_wait_every_work_in_order_and_name_the_peer_of_a_failed_one():
    log: list = []
    works = [_Work(log, "a"), _Work(log, "b", RuntimeError("NCCL error: remote process exited")), _Work(log, "c")]
    me = SimpleNamespace(device=None)  # host=False: no device work
    with pytest.raises(RuntimeError, match=r"delta transfer with process 4 \(message to or from 4\) failed: NCCL"):
        P2PSchedule._wait_inline(me, RunClock(), works, [_op(3), _op(4), _op(5)], "delta transfer", host=False)
    assert log == ["a", "b"]  # stops at the failed one
    log.clear()
    P2PSchedule._wait_inline(me, RunClock(), works[:1] + works[2:], [_op(3), _op(5)], "delta transfer", host=False)
    assert log == ["a", "c"]
