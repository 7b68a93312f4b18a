"""Fixtures of the cluster tests (``pytest -m cluster``): hosts as network namespaces on this machine.

``cluster``: four hosts a, b, c, d (trainer host, two engine hosts, a stranger's host), each link shaped to
1 Gbit/s both ways, made once per module and torn down after it. Where namespaces cannot be made (not root, no
iproute2) every test that asks for it is skipped with that reason.
"""

from __future__ import annotations

import pytest

from refit.tools.cluster import Cluster, LinkShape, parse_rate

from .helpers import skip_without_namespaces

HOSTS = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def cluster():
    skip_without_namespaces()
    with Cluster(HOSTS, LinkShape(parse_rate("1gbit"))) as c:
        yield c
