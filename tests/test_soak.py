"""Soak: 200 consecutive refits on CPU; resident memory, threads and process groups must not grow."""

import pytest

from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.soak import soak


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commit", ["in_place", "staged"])
def test_200_refits_do_not_grow_memory_threads_or_groups(commit):
    shapes = param_shapes("tiny-llama")
    src, dst = (
        layout_from_spec(shapes, parse_spec("tp=2", "src")),
        layout_from_spec(shapes, parse_spec("tp=1,dp=2", "dst")),
    )
    res = soak(
        src, dst, refits=200, warmup=20, config=TransferConfig(num_buffers=2, buffer_bytes=64 << 10, commit=commit)
    )
    assert len(res.rows) == 4
    assert res.worst_rss_growth <= 0.05, [(r["rss_warm"], r["rss_end"]) for r in res.rows]
    assert all(r["threads_end"] == r["threads_warm"] and r["groups_end"] == r["groups_warm"] for r in res.rows)
    assert all(r["exact"] for r in res.rows if r["role"] == "engine")  # the 200th refit's weights, bit for bit
    assert all(r["refit_threads_closed"] == [] for r in res.rows), res.rows  # close() joined the waiter thread
    assert res.ok
