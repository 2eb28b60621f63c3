"""Horovod's Gloo rendezvous server, run by the cluster launcher inside the switch namespace.

    ip netns exec <prefix>sw python -m hvd_quant.cluster.rendezvous h0:1,h1:1

Starts ``horovod.runner.http.http_server.RendezvousServer`` (what ``horovodrun --gloo``
starts in its own process), initialises it with the slot plan (rank ``r`` on host
``r // slots``, the layout ``horovodrun -H h0:k,h1:k`` gives), prints ``port <N>`` on one
line and serves until its standard input closes, so it cannot outlive the launcher.
The ranks reach it at the bridge address, so it must run in the switch namespace:
``RendezvousServer.start`` binds all addresses of the namespace it runs in.
"""

import sys


def slot_plan(hosts_spec):
    """``[SlotInfo]`` for ``"h0:2,h1:2"``: ranks fill hosts in order (Horovod's layout)."""
    from horovod.runner.common.util.hosts import SlotInfo

    hosts = []
    for item in hosts_spec.split(","):
        name, _, slots = item.partition(":")
        hosts.append((name, int(slots or 1)))
    size = sum(s for _, s in hosts)
    plan, rank = [], 0
    for cross_rank, (name, slots) in enumerate(hosts):
        for local_rank in range(slots):
            # cross_size: hosts that have this local rank (all of them with uniform slots).
            cross_size = sum(1 for _, s in hosts if s > local_rank)
            plan.append(SlotInfo(hostname=name, rank=rank, local_rank=local_rank,
                                 cross_rank=cross_rank, size=size, local_size=slots,
                                 cross_size=cross_size))
            rank += 1
    return plan


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hvd_quant.cluster.rendezvous h0:SLOTS,h1:SLOTS,...", file=sys.stderr)
        return 2
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(slot_plan(argv[0]))
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()  # returns at EOF: the launcher closed the pipe or died
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
