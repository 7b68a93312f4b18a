"""The Megatron-Core page's example runs as written, and the oracle it checks against inverts Megatron's cuts.

The page's block marked ``<!-- snippet: run by tests/test_megatron_doc.py -->`` is written to a file in an empty
temporary folder and run as a script with this interpreter, with no job secret in its environment (the block
makes its own), exactly as a reader who copies it would: 4 Megatron-Core trainer processes (TP=2 x PP=2) train
and refit 2 engine processes of their own twice; trainer rank 0 compares every engine shard with the trainers'
weights gathered by ``megatron_cpu.gather_hf_state`` and prints a PASS line. The generic snippet runner skips
blocks so marked (one run per CI, here). The block picks two free ports and binds them seconds later: under a
parallel test run another process can take one meanwhile, and only then it runs again: the block's store cannot
bind ("Address already in use"), or another test's store listens there first and refuses the block's processes,
which hold the block's own secret ("the store refused this process").
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import refit.tools.megatron_cpu as mc  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "integrations" / "megatron-core.md"
MARK = "<!-- snippet: run by tests/test_megatron_doc.py -->"
PORT_TAKEN = ("Address already in use", "the store refused this process")  # a port the block picked, taken first


def page_block() -> str:
    """The one ```python block right after ``MARK`` on the page."""
    text = PAGE.read_text()
    blocks = re.findall(re.escape(MARK) + r"\n```python\n(.*?)\n```", text, re.S)
    assert len(blocks) == 1, f"{PAGE}: expected one python block right after {MARK!r}, found {len(blocks)}"
    return blocks[0]


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_the_pages_example_refits_tp2_pp2_into_engine_processes_bit_exact(tmp_path):
    script = tmp_path / "megatron_example.py"
    script.write_text(page_block())
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}  # no secret: the block makes one
    for _ in range(2):  # a second run only where a port the block picked was taken before it bound it
        run = subprocess.run(
            [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=410
        )
        if run.returncode == 0 or not any(m in run.stderr for m in PORT_TAKEN):
            break
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    lines = run.stdout.splitlines()
    assert any(line.startswith("PASS: TP=2 x PP=2 GPTModel refit into 2 engine processes") for line in lines), (
        run.stdout
    )
    checked = [re.fullmatch(r"version (\d): loss [\d.]+, (\d+) engine shards equal the trainer's", x) for x in lines]
    checked = [(int(m[1]), int(m[2])) for m in checked if m]
    # tiny Llama, 4 layers: 9 tensors a layer + embed, norm, lm_head = 39 HF tensors, each on both engine ranks
    assert checked == [(1, 78), (2, 78)], run.stdout


@pytest.mark.parametrize(
    ("full_shape", "dim", "stride", "world"),
    [((8, 3), 0, 1, 2), ((8, 3), 0, 2, 2), ((3, 12), 1, 1, 4), ((12, 2), 0, 2, 3), ((16, 4), 0, 2, 4)],
)
def test_unshard_inverts_megatrons_cut(full_shape, dim, stride, world):
    """``gather_state`` joins TP shards with ``_unshard``; it must undo ``_shard`` (Megatron's cut of a master
    weight: pieces of ``local / stride``, rank ``r`` holding pieces ``r, r + world, ...``) for every stride."""
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float32).reshape(full_shape)
    local = list(full_shape)
    local[dim] //= world
    p = torch.empty(local)
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    shards = [mc._shard(full, p, r, world) for r in range(world)]
    assert all(tuple(s.shape) == tuple(local) for s in shards)
    assert len({s[(0,) * s.dim()].item() for s in shards}) == world  # each rank holds different rows
    assert torch.equal(mc._unshard(shards, dim, stride), full)
