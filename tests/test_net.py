"""NIC discovery and selection against fake sysfs trees."""

import os
import warnings

import pytest

from refit.transport.nics import discover_gpus, discover_nics, env_number, nic_settings, pci_hops, select_nics, ucx_env


class FakeSysfs:
    """A /sys with PCI devices under devices/, NICs under class/infiniband, GPUs under bus/pci."""

    def __init__(self, root):
        self.root = root
        (root / "class" / "infiniband").mkdir(parents=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def _pci(self, path, numa):
        d = self.root / "devices" / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{numa}\n")
        return d

    def nic(self, name, path, rate, numa, state="4: ACTIVE", ports=1):
        d = self._pci(path, numa)
        ib = self.root / "class" / "infiniband" / name
        ib.mkdir()
        os.symlink(d, ib / "device")
        for p in range(1, ports + 1):
            port = ib / "ports" / str(p)
            port.mkdir(parents=True)
            (port / "rate").write_text(f"{rate} Gb/sec (4X NDR)\n")
            (port / "state").write_text(state + "\n")
            (port / "link_layer").write_text("InfiniBand\n")

    def gpu(self, path, numa):
        d = self._pci(path, numa)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        os.symlink(d, self.root / "bus" / "pci" / "devices" / path.split("/")[-1])


def _node(tmp_path, n_nics, side_fabric=False):
    """GPUs and NICs in pairs under PCIe switches: GPU i and NIC i share switch i; half per socket."""
    fs = FakeSysfs(tmp_path)
    for i in range(n_nics):
        rc = f"pci0000:{0x10 * (i // (n_nics // 2)):02x}"
        sw = f"{rc}/0000:{i:02x}:01.0/0000:{i:02x}:02.0"
        fs.gpu(f"{sw}/0000:{i:02x}:03.0", numa=i // (n_nics // 2))
        fs.nic(f"mlx5_{i}", f"{sw}/0000:{i:02x}:04.0", 400, numa=i // (n_nics // 2))
    if side_fabric:
        fs.nic("mlx5_bond_0", "pci0000:00/0000:90:01.0/0000:91:00.0", 25, numa=0)
        fs.nic("mlx5_down", "pci0000:00/0000:92:01.0/0000:93:00.0", 400, numa=0, state="1: DOWN")
    return fs


def test_four_nic_node(tmp_path):
    _node(tmp_path, 4)
    nics, gpus = discover_nics(tmp_path), discover_gpus(tmp_path)
    assert [n.name for n in nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [g.numa_node for g in gpus] == [0, 0, 1, 1] and all(n.rate_gbps == 400 for n in nics)
    for g in gpus:  # auto: the NIC under the GPU's own switch
        assert [n.name for n in select_nics(g, nics, "auto")] == [f"mlx5_{g.index}"]
    stripe = select_nics(gpus[2], nics, "stripe")
    assert [n.name for n in stripe][0] == "mlx5_2" and len(stripe) == 4
    assert stripe[1].numa_node == 1  # then the same socket's NIC
    assert ucx_env(stripe, env={}) == {
        "UCX_NET_DEVICES": "mlx5_2:1,mlx5_3:1,mlx5_0:1,mlx5_1:1",
        "UCX_MAX_RMA_RAILS": "4",
    }
    assert nic_settings(1, tmp_path, env={}) == {"UCX_NET_DEVICES": "mlx5_1:1", "UCX_MAX_RMA_RAILS": "1"}


def test_eight_nic_node_side_fabric_filtered(tmp_path):
    _node(tmp_path, 8, side_fabric=True)
    nics = discover_nics(tmp_path)
    assert "mlx5_down" not in [n.name for n in nics]  # inactive port skipped
    assert any(n.name == "mlx5_bond_0" and n.rate_gbps == 25 for n in nics)
    gpus = discover_gpus(tmp_path)
    assert len(gpus) == 8
    stripe = select_nics(gpus[5], nics, "stripe")
    assert len(stripe) == 8 and "mlx5_bond_0" not in [n.name for n in stripe]
    # the rails setting is left alone when the user set it
    env = {"REFIT_NIC_MODE": "stripe", "UCX_MAX_RMA_RAILS": "2"}
    out = nic_settings(5, tmp_path, env=env)
    assert out["UCX_NET_DEVICES"].split(",")[0] == "mlx5_5:1" and "UCX_MAX_RMA_RAILS" not in out
    # a minimum rate above the fabric's leaves nothing: no UCX settings, not a wrong NIC
    assert nic_settings(5, tmp_path, env={"REFIT_NIC_MIN_RATE_GBPS": "800"}) == {}
    # a minimum rate that keeps only the 400G NICs
    assert len(select_nics(gpus[0], nics, "stripe", min_rate_gbps=100)) == 8


def test_node_without_rdma(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.gpu("pci0000:00/0000:01:00.0", 0)
    assert discover_nics(tmp_path) == []
    assert nic_settings(0, tmp_path, env={"REFIT_NIC_MODE": "stripe"}) == {}
    assert discover_nics(tmp_path / "nothing-here") == []
    with pytest.raises(ValueError, match="GPU 3 not found"):
        nic_settings(3, tmp_path, env={})


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "abc", "-inf"])
def test_invalid_rate_settings_fall_back_with_a_warning(tmp_path, raw):
    _node(tmp_path, 8, side_fabric=True)
    with pytest.warns(UserWarning, match=rf"REFIT_NIC_MIN_RATE_GBPS='{raw}' is not a finite number >= 0"):
        assert env_number("REFIT_NIC_MIN_RATE_GBPS", None, {"REFIT_NIC_MIN_RATE_GBPS": raw}) is None
    with pytest.warns(UserWarning, match="REFIT_NIC_MIN_RATE_GBPS"):
        out = nic_settings(0, tmp_path, env={"REFIT_NIC_MIN_RATE_GBPS": raw, "REFIT_NIC_MODE": "stripe"})
    assert len(out["UCX_NET_DEVICES"].split(",")) == 8  # the default: side fabric still filtered


def test_valid_numbers_and_modes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env_number("X", 5.0, {}) == 5.0
        assert env_number("X", 5.0, {"X": " "}) == 5.0
        assert env_number("X", 5.0, {"X": "0"}) == 0.0
        assert env_number("X", None, {"X": "200"}) == 200.0
    with pytest.warns(UserWarning, match="REFIT_NIC_MODE='fast' is not one of auto, stripe, off"):
        from refit.transport.nics import env_mode

        assert env_mode({"REFIT_NIC_MODE": "fast"}) == "auto"


def test_pci_hops():
    a = ("pci0000:00", "0000:00:01.0", "0000:01:00.0")
    assert pci_hops(a, a) == 0
    assert pci_hops(a, ("pci0000:00", "0000:00:01.0", "0000:01:00.1")) == 2
    assert pci_hops(a, ("pci0000:80", "0000:80:01.0")) == 6
