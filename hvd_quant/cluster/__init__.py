"""An emulated cluster on one machine: hosts as network namespaces behind shaped links.

    from hvd_quant.cluster import EmulatedCluster

    with EmulatedCluster(hosts=2, slots=1, rate="1gbit", delay="0.5ms") as cluster:
        result = cluster.run_horovod([sys.executable, "train.py"], timeout=600)

Command line (root, iproute2)::

    python -m hvd_quant.cluster check
    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --delay 1ms -- python train.py
    python -m hvd_quant.cluster cleanup

Modules: :mod:`.emulated` (the cluster and its link model), :mod:`.netns` (namespaces,
veth, tc), :mod:`.launch` (ranks, output, fail-fast, time limit), :mod:`.rendezvous`
(Horovod's Gloo rendezvous server in the switch namespace). Needs neither torch nor
Horovod to import; the ranks need whatever their script imports.
"""

from .emulated import ClusterInterrupted, EmulatedCluster
from .launch import JobFailed, JobResult, JobTimeout
from .netns import (ClusterError, ClusterUnavailable, check_requirements, format_rate, parse_delay,
                    parse_rate, probe, requirement_problems)

__all__ = ["ClusterError", "ClusterInterrupted", "ClusterUnavailable", "EmulatedCluster",
           "JobFailed", "JobResult", "JobTimeout", "check_requirements", "format_rate",
           "parse_delay", "parse_rate", "probe", "requirement_problems"]
