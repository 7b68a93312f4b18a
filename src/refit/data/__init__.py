"""The data plane: rollout batches from rollout workers to data-parallel trainer ranks through
a store of tensor columns (``Store``: ``InProcessStore``, ``RayStore``), planned on the driver
from small columns (``BatchMeta``, ``balanced_shards``), fetched by each rank (``leader_fetch``
inside a model-parallel group), with a versioned ``ReplayBuffer`` for asynchronous RL."""

from .balance import (
    balance_stats,
    balanced_shards,
    greedy_partition,
    inverse_permutation,
    karmarkar_karp,
    pack_microbatches,
    restore_order,
    sample_flops,
    shard_order,
)
from .leader import LeaderFetchError, leader_fetch, replica_groups
from .meta import BatchMeta
from .replay import BufferFull, ReplayBuffer, ReplayStats
from .store import InProcessStore, MissingFieldError, MissingKeyError, StorageUnit, Store

__all__ = [
    "BatchMeta",
    "Store",
    "InProcessStore",
    "StorageUnit",
    "MissingKeyError",
    "MissingFieldError",
    "balanced_shards",
    "karmarkar_karp",
    "greedy_partition",
    "sample_flops",
    "shard_order",
    "inverse_permutation",
    "restore_order",
    "balance_stats",
    "pack_microbatches",
    "ReplayBuffer",
    "ReplayStats",
    "BufferFull",
    "leader_fetch",
    "replica_groups",
    "LeaderFetchError",
    "RayStore",
]


def __getattr__(name: str):
    if name == "RayStore":  # imports ray only when asked for
        from .ray_store import RayStore

        return RayStore
    raise AttributeError(name)
