import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from refit.layout import (
    LayoutError,
    Mesh,
    ModelLayout,
    TensorLayout,
    box_is_contiguous,
    box_numel,
    box_slices,
    chunk_range,
    split_box,
)
from strategies import meshes, placements_for, tensor_shapes


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_range_matches_torch_chunk(size, n):
    x = torch.arange(size)
    chunks = list(torch.chunk(x, n)) if size else []
    for i in range(n):
        a, b = chunk_range(0, size, n, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert x[a:b].tolist() == want


def _dtensor_local(shape, mesh_shape, coords, placements):
    """Independent reference: slice an arange the way DTensor does, one mesh dim after another."""
    x = torch.arange(math.prod(shape)).reshape(shape)
    for c, n, p in zip(coords, mesh_shape, placements):
        if isinstance(p, Shard):
            parts = list(torch.chunk(x, n, dim=p.dim))
            if c < len(parts):
                x = parts[c]
            else:
                empty = list(x.shape)
                empty[p.dim] = 0
                x = x.new_empty(empty)
    return x


@given(st.data())
def test_boxes_match_dtensor_chunking(data):
    world = data.draw(st.integers(1, 8))
    mesh = data.draw(meshes(world))
    shape = data.draw(tensor_shapes())
    pls = data.draw(placements_for(mesh, len(shape)))
    t = TensorLayout("w", shape, torch.float32, mesh, pls)
    full = torch.arange(math.prod(shape)).reshape(shape)
    for r in range(world):
        want = _dtensor_local(shape, mesh.shape, mesh.coords(r), pls)
        got = full[box_slices(t.box(r))]
        assert got.shape == want.shape
        assert torch.equal(got, want)


@given(st.data())
def test_boxes_match_torch_private_dtensor_helper(data):
    helper = pytest.importorskip("torch.distributed.tensor._utils")._compute_local_shape_and_global_offset
    world = data.draw(st.integers(1, 8))
    mesh = data.draw(meshes(world))
    shape = data.draw(tensor_shapes())
    pls = data.draw(placements_for(mesh, len(shape)))
    t = TensorLayout("w", shape, torch.float32, mesh, pls)
    for r in range(world):
        local_shape, offset = helper(shape, mesh.shape, list(mesh.coords(r)), pls)
        box = t.box(r)
        assert tuple(b - a for a, b in box) == tuple(local_shape)
        # DTensor reports offset = global size for empty shards; compare non-empty ones only
        for (a, _), o, n in zip(box, offset, local_shape):
            if n:
                assert a == o


def test_mesh_coords_and_nested():
    m = Mesh.from_nested([[4, 5, 6], [7, 8, 9]], ("dp", "tp"))
    assert m.coords(8) == (1, 1)
    assert m.coords(3) is None
    assert m.to_nested() == [[4, 5, 6], [7, 8, 9]]
    with pytest.raises(LayoutError, match="repeat"):
        Mesh((2,), ("tp",), (1, 1))
    with pytest.raises(LayoutError, match="holds 4 ranks, got 3"):
        Mesh((2, 2), ("a", "b"), (0, 1, 2))


def test_tensor_layout_errors_name_the_tensor():
    m = Mesh((2,), ("tp",), (0, 1))
    with pytest.raises(LayoutError, match="'w'.*out of range"):
        TensorLayout("w", (4,), torch.float32, m, (Shard(1),))
    with pytest.raises(LayoutError, match="'w': 2 placements for a 1-d mesh"):
        TensorLayout("w", (4,), torch.float32, m, (Shard(0), Replicate()))
    with pytest.raises(LayoutError, match="outside 0..0"):
        ModelLayout((TensorLayout("w", (4,), torch.float32, m, (Shard(0),)),), world_size=1)


@given(tensor_shapes(max_dims=4, max_size=7), st.integers(1, 50))
def test_split_box_tiles_in_order(shape, max_numel):
    box = tuple((0, s) for s in shape)
    pieces = split_box(box, max_numel)
    assert all(box_numel(p) <= max_numel for p in pieces)
    count = torch.zeros(shape, dtype=torch.int32)
    for p in pieces:
        count[box_slices(p)] += 1
    assert bool((count == 1).all())


@given(st.data())
def test_box_is_contiguous_agrees_with_torch(data):
    shape = data.draw(tensor_shapes(max_dims=4, max_size=5))
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        box.append((a, b))
    view = torch.empty(shape)[box_slices(tuple(box))]
    assert box_is_contiguous(tuple(box), shape) == view.is_contiguous()
