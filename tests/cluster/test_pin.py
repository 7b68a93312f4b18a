"""``pin_from_env``, run when refit is imported: ``REFIT_BIND_ADDRESS`` set to an address of this host pins gloo
and NCCL to its interface (the user's own choice wins); loopback and every-interface pin nothing; an address no
interface holds pins nothing and warns. Needs no namespaces (the cluster tests show the effect across hosts)."""

from __future__ import annotations

import os

import psutil
import pytest

from refit.transport.store import BIND_ENV, pin_from_env

IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture
def env(monkeypatch):
    for k in IFNAMES:  # set, then deleted: undone at the end whatever pin_from_env writes in between
        monkeypatch.setenv(k, "unset")
        monkeypatch.delenv(k)
    return monkeypatch


def _non_loopback() -> tuple[str, str] | None:
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return name, a.address
    return None


def test_an_address_of_this_host_pins_gloo_and_nccl_to_its_interface(env):
    found = _non_loopback()
    if found is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    name, address = found
    env.setenv(BIND_ENV, address)
    assert pin_from_env() == name
    assert os.environ["GLOO_SOCKET_IFNAME"] == name
    assert os.environ["NCCL_SOCKET_IFNAME"] == f"={name}"


def test_the_users_own_interface_wins(env):
    found = _non_loopback()
    if found is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    env.setenv(BIND_ENV, found[1])
    env.setenv("GLOO_SOCKET_IFNAME", "mine0")
    assert pin_from_env() == "mine0"


@pytest.mark.parametrize("address", [None, "127.0.0.1", "0.0.0.0", "::"])
def test_loopback_and_every_interface_pin_nothing(env, address):
    if address is None:
        env.delenv(BIND_ENV, raising=False)
    else:
        env.setenv(BIND_ENV, address)
    assert pin_from_env() is None
    assert not any(k in os.environ for k in IFNAMES)


def test_an_address_of_no_interface_pins_nothing_and_warns(env):
    env.setenv(BIND_ENV, "192.0.2.77")  # TEST-NET-1: never an address of this host
    with pytest.warns(UserWarning, match="192.0.2.77.*is not an address of any interface"):
        assert pin_from_env() is None
    assert not any(k in os.environ for k in IFNAMES)
