"""Pre-flight through an in-process store: each "process" publishes its plan, one checks the others."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from refit.config import TransferConfig
from refit.errors import PlanError
from refit.layout import Mesh, ModelLayout, TensorLayout
from refit.plan import ProcessMap, build_plan
from refit.transfer import check_peers, preflight, publish_failure, publish_plan
from refit.transport.store import SignedStore

PEERS = [0, 1, 2, 3]  # source ranks 0, 1 and destination ranks 0, 1 as processes 0..3


def _store() -> SignedStore:
    return SignedStore(dist.HashStore(), b"preflight-test-secret")


def _plan(dst_placement=None, shape=(8, 4), devices=None, **config):
    dst_placement = dst_placement or Shard(0)
    src = ModelLayout((TensorLayout("w", shape, torch.float32, Mesh((2,), ("fsdp",), (0, 1)), (Shard(0),)),), 2)
    dst = ModelLayout((TensorLayout("w", shape, torch.float32, Mesh((2,), ("tp",), (0, 1)), (dst_placement,)),), 2)
    procs = ProcessMap.disjoint(2, 2) if devices is None else ProcessMap.disjoint(2, 2).with_devices(devices)
    return build_plan(src, dst, procs, TransferConfig(**config))


def _check(plans, tag_bases=None):
    """Every process but 0 publishes its plan; process 0 runs the whole pre-flight."""
    store = _store()
    tag_bases = tag_bases or {}
    for proc, plan in plans.items():
        if proc != 0:
            publish_plan(plan, proc, store, "t", tag_bases.get(proc, 0))
    preflight(plans[0], 0, store, 5.0, "t", tag_bases.get(0, 0))
    return store


def test_equal_plans_pass_on_every_process():
    plan = _plan()
    store = _check(dict.fromkeys(PEERS, plan))
    for proc in PEERS[1:]:
        check_peers(proc, PEERS, store, 5.0, "t")


def test_a_differing_agreed_setting_is_named_with_both_values():
    plans = dict.fromkeys(PEERS, _plan())
    plans[3] = _plan(stages=2)
    with pytest.raises(PlanError, match=r"^pre-flight: process 0 has stages=1, process 3 has stages=2$"):
        _check(plans)


def test_a_differing_tag_base_is_named_with_both_values():
    with pytest.raises(PlanError, match=r"^pre-flight: process 0 has tag_base=0, process 2 has tag_base=100$"):
        _check(dict.fromkeys(PEERS, _plan()), tag_bases={2: 100})


def test_a_differing_layout_names_the_tensor_and_the_rank():
    plans = dict.fromkeys(PEERS, _plan())
    plans[1] = _plan(dst_placement=Shard(1))
    with pytest.raises(PlanError) as e:
        _check(plans)
    msg = str(e.value)
    assert msg.startswith(
        f"pre-flight: plan digest of process 0 is {plans[0].digest}, of process 1 is {plans[1].digest}"
    )
    assert "destination tensor 'w' is sharded differently: destination rank 0 holds [[0, 4], [0, 4]] here" in msg
    assert "[[0, 8], [0, 2]] there" in msg


def test_a_differing_shape_names_the_tensor_and_both_shapes():
    plans = dict.fromkeys(PEERS, _plan())
    plans[2] = _plan(shape=(8, 6))
    with pytest.raises(PlanError, match=r"first differing source tensor: here \['w', \[8, 4\], 'float32'\], there"):
        _check(plans)


def test_differing_devices_name_the_process():
    plans = dict.fromkeys(PEERS, _plan(devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"]))
    plans[1] = _plan(devices=["cuda:0", "cuda:1", "cuda:2", "cuda:2"])
    with pytest.raises(PlanError, match="devices differ: process 3 is on cuda:3 here, on cuda:2 there"):
        _check(plans)


def test_a_peers_setup_error_is_reported():
    plan = _plan()
    store = _store()
    publish_failure(store, 1, ValueError("local tensor 'w' has shape [3, 3]"))
    with pytest.raises(PlanError, match=r"process 1 failed its setup: ValueError: local tensor 'w' has shape \[3, 3\]"):
        preflight(plan, 0, store, 5.0)


def test_a_peer_of_another_version_is_named():
    store = _store()
    store.put("refit/preflight/1", {"digest": "0123", "src": [], "dst": []})
    with pytest.raises(PlanError, match="process 1 published a plan record of another refit version"):
        preflight(_plan(), 0, store, 5.0)


def test_a_silent_peer_times_out_naming_it():
    plan = _plan()
    store = _store()
    publish_plan(plan, 1, store)
    with pytest.raises(PlanError, match="process 2 did not publish its plan within 1s"):
        preflight(plan, 0, store, 1.0)


def test_one_process_needs_no_store():
    src = ModelLayout((TensorLayout("w", (4,), torch.float32, Mesh((1,), ("tp",), (0,)), (Replicate(),)),), 1)
    preflight(build_plan(src, src, ProcessMap.colocated(1, 1)), 0, None, 1.0)
