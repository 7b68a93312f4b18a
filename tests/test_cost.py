"""The cost model: topology validation, resource accounting, strategies, CLI."""

import json
import math
from pathlib import Path

import pytest

from refit.config import TransferConfig
from refit.cost import (
    Topology,
    TopologyError,
    broadcast_time,
    delta_time,
    loads,
    p2p_transfers,
    predict,
    relay_gpus,
    relay_seconds,
    transfer_time,
    wave_transfers,
    waves_time,
)
from refit.delta.rule import LINKS, prefer_words
from refit.delta.wire import wire_sizes
from refit.fanout_relay import chunk_bytes_for
from refit.fanout_waves import waves_for
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import build_plan, link_bytes

GB = 10**9
TOPOLOGIES = Path(__file__).parents[1] / "bench" / "topologies"


def topo(**kw):
    return Topology(
        **{
            "nodes": 2,
            "gpus_per_node": 4,
            "nvlink_gbps": 400,
            "nccl_gbps": 400,
            "hbm_gbps": 4000,
            "nics_per_node": 4,
            "nic_gbps": 50,
            "pcie_gbps": 60,
            **kw,
        }
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("nodes", 0),
        ("nvlink_gbps", math.nan),
        ("nic_gbps", math.inf),
        ("hbm_gbps", -1),
        ("gpus_per_node", 2.5),
        ("nic_mode", "fast"),
    ],
)
def test_topology_rejects_bad_numbers(field, value):
    with pytest.raises(TopologyError, match=field):
        topo(**{field: value})


def test_topology_from_json(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"nodes": 1, "gpus_per_node": 2}))
    t = Topology.from_json(p)
    assert t.gpus == 2 and t.name == "t.json"
    p.write_text(json.dumps({"nodes": 1, "gpus_per_node": 2, "nvlink": 3}))
    with pytest.raises(TopologyError, match=r"unknown fields \['nvlink'\]"):
        Topology.from_json(p)
    p.write_text("{")
    with pytest.raises(TopologyError, match="cannot read topology"):
        Topology.from_json(p)


def test_resources():
    t = topo()
    secs, raw = loads({(0, 0): 4 * GB}, t)  # a same-GPU copy reads and writes
    assert raw[("hbm", 0)] == 8 * GB and secs[("hbm", 0)] == pytest.approx(8 / 4000)
    assert transfer_time({(0, 1): 4 * GB}, t) == (pytest.approx(0.01), "nvlink_out of GPU 0", 4 * GB)
    # across nodes: one NIC per GPU in auto mode
    s, where, _ = transfer_time({(0, 4): 5 * GB}, t)
    assert s == pytest.approx(0.1) and where == "nic_out of GPU 0"
    # stripe: all 4 NICs (200 GB/s) capped by PCIe (60)
    s, _, _ = transfer_time({(0, 4): 6 * GB}, topo(nic_mode="stripe"))
    assert s == pytest.approx(0.1)
    # four GPUs of node 0 each send 5 GB off the node: the node's NICs (200 GB/s) carry 20 GB
    s, where, n = transfer_time({(g, 4 + g): 5 * GB for g in range(4)}, t)
    assert s == pytest.approx(0.1) and n == 5 * GB
    s, where, n = transfer_time({(g, 4 + g): 5 * GB for g in range(4)}, topo(nic_mode="stripe", pcie_gbps=200))
    assert where == "node_nic_out of node 0" and n == 20 * GB and s == pytest.approx(0.1)


def test_first_nic_mode_sends_a_whole_node_through_one_nic():
    # two GPUs of node 0 each send 5 GB off the node, 2 NICs of 50 GB/s: "auto" gives each its own NIC,
    # "first" (gloo on NICs sharing a subnet) puts both on NIC 0; a GPU alone gets one NIC either way
    sends = {(0, 4): 5 * GB, (1, 5): 5 * GB}
    s, where, _ = transfer_time(sends, topo(nics_per_node=2))
    assert s == pytest.approx(0.1) and where.startswith("nic_out of GPU")
    s, where, n = transfer_time(sends, topo(nics_per_node=2, nic_mode="first"))
    assert s == pytest.approx(0.2) and where == "node_nic_out of node 0" and n == 10 * GB
    assert transfer_time({(0, 4): 5 * GB}, topo(nics_per_node=2, nic_mode="first"))[0] == pytest.approx(0.1)
    assert "first (50 GB/s per GPU)" in topo(nic_mode="first").describe()


def test_the_two_nic_cpu_cluster_topology_predicts_gloo_on_one_nic_and_nixl_on_two():
    t = Topology.from_json(TOPOLOGIES / "cpu-cluster-1gbit-2nic.json")
    shapes = param_shapes("tiny-llama")
    src, dst = (
        layout_from_spec(shapes, parse_spec("fsdp=2", "src")),
        layout_from_spec(shapes, parse_spec("tp=1,dp=2", "dst")),
    )
    got = {p.strategy: p for p in predict(src, dst, t, nixl_nic_mode="auto")}
    # each trainer rank sends its half to both replicas: over NIXL each through its own NIC, over gloo both
    # through host a's first NIC, twice as long
    assert got["p2p"].seconds == pytest.approx(2 * got["nixl"].seconds, rel=0.01)
    assert got["p2p"].busiest == "node_nic_out of node 0" and got["nixl"].busiest.startswith("nic_")
    with pytest.raises(TopologyError, match="nixl_nic_mode must be 'auto' or 'stripe', got 'first'"):
        predict(src, dst, t, nixl_nic_mode="first")


def test_broadcast():
    t = topo()
    assert broadcast_time(8 * GB, 1, 3, t)[0] == pytest.approx(0.02)  # inside node 0: NVLink
    s, where = broadcast_time(8 * GB, 1, 6, t)  # GPUs 1..6 span both nodes
    assert s == pytest.approx(8 / 50) and "nic" in where
    with pytest.raises(TopologyError, match="need 9 GPUs; the topology has 8"):
        broadcast_time(GB, 1, 8, t)


def test_link_bytes_match_the_plan():
    shapes = param_shapes("tiny-qwen3-moe")
    src, dst = (
        layout_from_spec(shapes, parse_spec("pp=2,ep=2", "src")),
        layout_from_spec(shapes, parse_spec("tp=2,dp=2", "dst")),
    )
    plan = build_plan(src, dst)
    lb = link_bytes(src, dst)
    assert {k: v for k, v in lb.items()} == {(s, r): b for s, row in plan.links.items() for r, b in row.items()}
    assert sum(lb.values()) == plan.bytes_needed


def test_predict_strategies_and_fanout():
    shapes = param_shapes("tiny-llama")
    src = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=1,dp=7", "dst"))
    one = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    t = topo()
    preds = {p.strategy: p for p in predict(src, dst, t, replicas=7, replica_dst=one)}
    assert set(preds) == {"broadcast", "p2p", "fanout"}
    # one trainer GPU sends 7 copies: its NIC (GPUs 4-7 are on node 1) is the bottleneck
    assert preds["p2p"].busiest.startswith("nic_out of GPU 0")
    # ceil(log2(8)) = 3 waves of the plans Fanout builds; 8 GPUs cannot give each replica a node of its own, so
    # they sit packed after the trainer's (GPUs 1-7), the last wave's 4 receivers across the nodes
    assert preds["fanout"].note.startswith("3 waves")
    waves = plan_transfers(src, one, t, (0,), [(g,) for g in range(1, 8)])
    assert [len(w) for w in waves] == [1, 2, 4]
    assert preds["fanout"].seconds == pytest.approx(sum(transfer_time(w, t)[0] for w in waves))
    # placement given explicitly
    tr = p2p_transfers(src, one, t, placement=((0,), (0,)))
    assert tr == {(0, 0): one.nbytes}
    with pytest.raises(TopologyError, match="GPUs \\[9\\]"):
        p2p_transfers(src, one, t, placement=((0,), (9,)))


def test_relay_prediction_is_one_copy_plus_the_pipeline_fill_and_degree_copies_per_relay():
    """A chain of R replicas on equal links: one copy over one link (the steady pipeline) times (chunks + R - 1) /
    chunks; a tree of degree 2: a relay's NIC sends two copies, and the tree is shallower. Replicas each on a node
    of their own, after the trainer's (fsdp=2 on node 0, like the namespace cluster's bench)."""
    assert relay_seconds(1.0, 32, 3) == pytest.approx(34 / 32)
    with pytest.raises(ValueError, match="chunks and depth"):
        relay_seconds(1.0, 0, 3)
    shapes = param_shapes("tiny-llama")
    src = layout_from_spec(shapes, parse_spec("fsdp=2", "src"))
    one = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    t = topo(nodes=4, gpus_per_node=2, nics_per_node=1, nic_gbps=0.125)
    assert relay_gpus(2, 1, 3, t) == [(2,), (4,), (6,)]
    assert relay_gpus(2, 1, 3, t, colocated=True) == [(0,), (2,), (4,)]
    with pytest.raises(TopologyError, match="needs 5 nodes of 2 GPUs; the topology has 4"):
        relay_gpus(2, 1, 4, t)
    chunks = -(-one.nbytes // chunk_bytes_for(one.nbytes, TransferConfig()))
    copy_s = one.nbytes / (0.125 * GB)  # one copy over one link
    for degree, steady, depth in ((1, copy_s, 3), (2, 2 * copy_s, 2)):
        preds = {p.strategy: p for p in predict(src, one, t, replicas=3, replica_dst=one, relay=degree)}
        assert preds["relay"].seconds == pytest.approx(steady * (chunks + depth - 1) / chunks)
        assert preds["relay"].busiest_bytes == one.nbytes * (1 if degree == 1 else 2)
    # the waves: 2 waves, node 0's uplink carrying more than one copy in the second (the test below)
    assert preds["fanout"].seconds > 2 * copy_s


def plan_transfers(trainer, replica, t, trainer_gpus, replica_gpus):
    """Per wave of a fan-out in waves, (source GPU, destination GPU) -> bytes of the plan ``Fanout`` runs
    (``build_plan`` of the wave, its messages' pieces), the processes naming their node as the namespace bench's
    do."""
    n_src, nr = trainer.world_size, replica.world_size
    gpu = [*trainer_gpus, *(g for gs in replica_gpus for g in gs)]
    rprocs = [list(range(n_src + j * nr, n_src + (j + 1) * nr)) for j in range(len(replica_gpus))]
    devices = [f"host{t.node(g)}/cpu{g}" for g in gpu]
    out = []
    for w in waves_for(trainer, replica, list(range(n_src)), rprocs, devices=devices):
        links = {}
        for m in build_plan(w.src_layout, w.dst_layout, w.procs).messages:
            k = (gpu[w.procs.src[m.src]], gpu[w.procs.dst[m.dst]])
            links[k] = links.get(k, 0) + sum(p.nbytes for p in m.pieces)
        out.append(links)
    return out


def waves_from_plans(trainer, replica, t, trainer_gpus, replica_gpus):
    """Per wave, the bytes each node's NIC sends and receives (links between two nodes), the busiest NIC's bytes
    over its rate; summed over the waves."""
    total = 0.0
    for links in plan_transfers(trainer, replica, t, trainer_gpus, replica_gpus):
        sent, received = {}, {}
        for (a, b), n in links.items():
            if t.node(a) != t.node(b):
                sent[t.node(a)] = sent.get(t.node(a), 0) + n
                received[t.node(b)] = received.get(t.node(b), 0) + n
        total += max([*sent.values(), *received.values()]) / (t.gpu_nic_gbps * GB)
    return total


def test_waves_prediction_is_the_busiest_nic_of_each_waves_plan_summed_and_follows_the_placement():
    """An fsdp=2 trainer and 3 tp=1 replicas on 1 Gbit/s nodes of one NIC (the namespace cluster's bench). The
    waves' prediction is, per wave of the plans Fanout builds, the busiest node NIC's bytes over its rate, summed.
    Both trainer ranks on node 0: the second wave balances bytes per sending rank, so node 0 sends more than one
    copy and the waves take more than two copies' time; the trainer ranks on nodes 0 and 1: two copies' time."""
    shapes = param_shapes("tiny-llama")
    src = layout_from_spec(shapes, parse_spec("fsdp=2", "src"))
    one = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    t = topo(nodes=5, gpus_per_node=2, nics_per_node=1, nic_gbps=0.125)
    copy_s = one.nbytes / (0.125 * GB)
    preds = {p.strategy: p for p in predict(src, one, t, replicas=3, replica_dst=one)}
    one_host = waves_from_plans(src, one, t, (0, 1), [(2,), (4,), (6,)])  # each replica on a node of its own
    assert preds["fanout"].seconds == pytest.approx(one_host)
    assert preds["fanout"].busiest == "node_nic_out of node 0" and preds["fanout"].busiest_bytes > one.nbytes
    assert one_host > 2 * copy_s * 1.05
    two_hosts = ((0, 2), [(4,), (6,), (8,)])
    spread = waves_time(src, one, t, 3, placement=two_hosts)
    assert spread[0] == pytest.approx(waves_from_plans(src, one, t, *two_hosts)) == pytest.approx(2 * copy_s)
    assert wave_transfers(src, one, t, (0, 1), [(2,), (4,), (6,)])[0] == {
        (0, 2): one.nbytes // 2,
        (1, 2): one.nbytes // 2,
    }
    with pytest.raises(TopologyError, match="GPUs for 2 replicas, not 3"):
        waves_time(src, one, t, 3, placement=((0, 1), [(2,), (4,)]))
    with pytest.raises(TopologyError, match="uses GPUs \\[10\\]; the topology has 10"):
        waves_time(src, one, t, 3, placement=((0, 1), [(2,), (4,), (10,)]))


def test_cli_cluster(tmp_path, capsys):
    from refit.tools.cli import main

    p = tmp_path / "topo.json"
    p.write_text(json.dumps({"nodes": 2, "gpus_per_node": 8}))
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny-qwen3-moe",
                "--src",
                "ep=2,tp=2",
                "--dst",
                "tp=2,dp=4",
                "--cluster",
                str(p),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [x["strategy"] for x in out["predictions"]] == ["broadcast", "p2p", "fanout"]
    assert all(x["seconds"] > 0 for x in out["predictions"])
    p.write_text(json.dumps({"nodes": 5, "gpus_per_node": 1}))
    args = ["plan", "--model", "tiny-llama", "--src", "tp=1", "--dst", "tp=1,dp=4", "--relay", "1"]
    assert main([*args, "--cluster", str(p), "--json"]) == 0
    relay = json.loads(capsys.readouterr().out)["predictions"][-1]
    assert relay["strategy"] == "relay" and "a chain of 4 replicas, 4 hops deep" in relay["note"]
    assert main(args) == 2
    assert "--relay 1 needs --cluster" in capsys.readouterr().err
    assert main([*args[:6], "tp=1", "--relay", "1", "--cluster", str(p)]) == 2
    assert "--relay 1 needs --dst with dp > 1" in capsys.readouterr().err
    p.write_text(json.dumps({"nodes": 1, "gpus_per_node": 4}))
    assert main(["plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=2,dp=2", "--cluster", str(p)]) == 2
    assert "need 6 GPUs; the topology has 4" in capsys.readouterr().err


def test_delta_prediction_is_dense_at_full_change_and_on_one_gpu_and_small_at_one_percent():
    t = topo()
    cross = {(0, 4): 10 * GB}  # one NIC link
    dense = transfer_time(cross, t)
    assert delta_time(cross, t, 1.0, 2)[0] == dense[0]  # everything changed: the rule sends dense
    secs, busiest, _, wire = delta_time(cross, t, 0.01, 2)
    # bf16 found per 64-bit word (as ``auto`` does over a CUDA link): a word of 4 elements changes with
    # probability 1 - 0.99**4, and travels as an int32 index + its 8 bytes
    words = round((1 - 0.99**4) * 10 * GB / 8)
    assert wire == wire_sizes(words) and 0.058 < wire / (10 * GB) < 0.06
    # the sender's find (base and current at the word find rate, then pack and base update) bounds it
    rate = LINKS["nic"]
    assert busiest == "find of GPU 0"
    assert secs == pytest.approx(2 * 10 * GB / (rate.word_find_gbps * 1e9) + words * 20 / (rate.apply_gbps * 1e9))
    assert secs < 0.35 * dense[0]
    nvlink = {(0, 1): 10 * GB}  # one node: words pay over NVLink too (the find reads at 1.7 TB/s)
    within, where, _, nv_wire = delta_time(nvlink, t, 0.01, 2)
    assert within < 0.7 * transfer_time(nvlink, t)[0] and where == "find of GPU 0" and nv_wire == wire
    same = {(1, 1): 10 * GB}  # the engine on the trainer's GPU: a delta never beats the copy
    assert delta_time(same, t, 0.001, 2)[:2] == transfer_time(same, t)[:2]
    with pytest.raises(TopologyError, match="changed fraction"):
        delta_time(cross, t, 1.5, 2)


def test_delta_prediction_follows_the_rules_choice_of_words_for_fp8():
    t = topo()
    cross = {(0, 4): 10 * GB}
    # FP8 over a NIC: per word ~11.6% of dense (a word of 8 elements changes with probability 1 - 0.99**8),
    # per element 5%, but the word find reads 2.2x faster: the rule (``prefer_words``) takes words, and the
    # prediction is what ``auto`` does
    assert prefer_words([(1 << 28, 1)], LINKS["nic"])
    assert delta_time(cross, t, 0.01, 1)[3] == wire_sizes(round((1 - 0.99**8) * 10 * GB / 8))


def test_cli_cluster_predicts_a_delta_with_its_wire_bytes(tmp_path, capsys):
    from refit.tools.cli import main

    p = tmp_path / "topo.json"
    p.write_text(json.dumps({"nodes": 2, "gpus_per_node": 2}))  # the engine on the other node: over NICs
    argv = ["plan", "--model", "llama-3.1-8b", "--src", "tp=2", "--dst", "tp=2", "--cluster", str(p), "--json"]
    assert main([*argv, "--changed-fraction", "0.01"]) == 0
    preds = {x["strategy"]: x for x in json.loads(capsys.readouterr().out)["predictions"]}
    assert preds["delta"]["seconds"] < 0.2 * preds["p2p"]["seconds"]
    assert "5.9% of dense" in preds["delta"]["note"]  # bf16 per 64-bit word: int32 index + 8 bytes
