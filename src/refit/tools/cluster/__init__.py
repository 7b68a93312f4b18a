"""Several hosts on one machine, for trying and testing multi-host refits: Linux network namespaces joined by
veth pairs to a bridge, each host's link shaped with ``tc`` (``harness.Cluster``), the processes of a job
placed on them (``job``), and the ``refit cluster`` command (``command``). Needs root and iproute2.
"""

from refit.tools.cluster.harness import Cluster, Host, LinkShape, Nic, parse_rate
from refit.tools.cluster.netns import ClusterError, unavailable

__all__ = ["Cluster", "ClusterError", "Host", "LinkShape", "Nic", "parse_rate", "unavailable"]
