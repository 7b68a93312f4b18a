"""refit's CUDA streams are its own: none is one of torch's pooled streams (``refit.cudart.private_stream``),
which an engine's ``torch.cuda.Stream()`` could be handed too. One GPU."""

import pytest
import torch

from refit.delta.words import side_stream
from refit.transport.ipc import IpcPuller

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pool(device: torch.device) -> set[int]:
    """Every stream torch's pool hands out on ``device`` (32 per priority, round-robin: 64 calls see all)."""
    return {torch.cuda.Stream(device).cuda_stream for _ in range(64)}


def test_ipc_lanes_and_side_streams_are_none_of_torchs_pool_and_close_frees_them():
    dev = torch.device("cuda", 0)
    srcs = [torch.randn(1 << 22, device=dev), torch.randn(1 << 21, device=dev), torch.randn(64, device=dev)]
    outs = [torch.empty_like(s) for s in srcs]
    puller = IpcPuller(dev, list(zip(outs, srcs)), [], streams_per_lane=2)
    ours = {stream.cuda_stream for _, stream, _ in puller.lanes}
    assert len(ours) == 3  # two streams for the large copies, one for the small copy
    ours.add(side_stream(dev, "find").cuda_stream)
    assert not ours & _pool(dev)
    puller.pull()
    torch.cuda.synchronize(dev)
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs))
    puller.close()
    assert puller.lanes == [] and puller.owned.streams == []
