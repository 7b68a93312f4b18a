"""Fault injection (`refit verify --inject`): every mode detected and handled, within the deadline.

Each run commits version 1, then the fault strikes during version 2 (commit mode
"staged", checksums on). Handled means: every surviving process raises the same
error, naming what happened, well within the deadline; nothing hangs; every
surviving engine rank still holds version 1 bit for bit (a refit that failed
half way left nothing half-applied).
"""

import pytest

from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.faults import MODES, inject

DEADLINE_S = 3.0


def _layouts(src, dst):
    shapes = param_shapes("tiny-llama")
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_injected_fault_is_detected_and_handled(mode):
    src, dst = _layouts("tp=2", "tp=1,dp=2")
    res = inject(src, dst, mode, deadline_s=DEADLINE_S)
    assert res.problems() == [], res.last_line()
    survivors = [r for r in res.rows if r is not None]
    assert len(survivors) == len(res.rows) - (1 if mode.startswith("kill") else 0)
    # within the deadline: the victim of slow-receiver oversleeps it by design, everyone else is prompt
    prompt = [r for p, r in enumerate(res.rows) if r is not None and not (mode == "slow-receiver" and p == res.victim)]
    assert all(r["elapsed_s"] < DEADLINE_S + 2 for r in prompt), [r["elapsed_s"] for r in prompt]
    engines = [r for r in survivors if r["role"] == "engine"]
    assert engines and all(r["version"] == 1 and r["v1_exact"] for r in engines)
    assert res.last_line().startswith(f"DETECTED {mode}:")


@pytest.mark.timeout(240)
def test_refit_failing_half_way_leaves_engine_bit_identical_to_last_version():
    # the sender dies half way through version 2's steps: some of version 2 had arrived
    src, dst = _layouts("fsdp=2", "tp=2")
    res = inject(src, dst, "kill-sender", deadline_s=DEADLINE_S)
    assert res.problems() == [], res.last_line()
    engines = [r for r in res.rows if r is not None and r["role"] == "engine"]
    assert len(engines) == 2 and all(r["version"] == 1 and r["v1_exact"] for r in engines)
