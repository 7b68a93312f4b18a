"""Hypothesis strategies for random meshes, placements and uneven shapes."""

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from refit.layout import Mesh, ModelLayout, TensorLayout


@st.composite
def tensor_shapes(draw, max_dims=3, max_size=9):
    ndim = draw(st.integers(1, max_dims))
    return tuple(draw(st.lists(st.integers(1, max_size), min_size=ndim, max_size=ndim)))


@st.composite
def meshes(draw, world_size, max_dims=3):
    """A mesh over all of 0..world_size-1 (a random permutation) with a random factorization."""
    dims, rest = [], world_size
    for _ in range(draw(st.integers(1, max_dims))):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        rest //= d
    dims[-1] *= rest
    ranks = draw(st.permutations(list(range(world_size))))
    return Mesh(tuple(dims), tuple(f"m{i}" for i in range(len(dims))), tuple(ranks))


@st.composite
def placements_for(draw, mesh, ndim):
    return tuple(draw(st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))) for _ in range(mesh.ndim))


@st.composite
def layout_pairs(draw):
    """(source ModelLayout, destination ModelLayout) of 1-3 tensors over random meshes of 1-6 ranks."""
    n_src, n_dst = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    src_mesh, dst_mesh = draw(meshes(n_src)), draw(meshes(n_dst))
    src, dst = [], []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(tensor_shapes())
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        src.append(TensorLayout(f"t{i}", shape, dtype, src_mesh, draw(placements_for(src_mesh, len(shape)))))
        dst.append(TensorLayout(f"t{i}", shape, dtype, dst_mesh, draw(placements_for(dst_mesh, len(shape)))))
    return ModelLayout(tuple(src), n_src), ModelLayout(tuple(dst), n_dst)
