"""Network namespaces, veth links and ``tc`` shaping: the plumbing of the emulated cluster.

Everything here is a thin, checked wrapper around iproute2 (``ip``, ``tc``); see
ip-netns(8), ip-link(8), tc-tbf(8) and tc-netem(8). Nothing is created in the machine's
own (root) network namespace: the bridge, both ends of every veth pair and every address
live in namespaces this module creates, so the emulated hosts have no route to any other
address and removing the namespaces removes every link with them.

Topology of a cluster with prefix ``P`` and ``n`` hosts::

    namespace P-h0: eth0 (10.a.b.1/24) ==veth== p0 ┐
    namespace P-h1: eth0 (10.a.b.2/24) ==veth== p1 ├─ br0 (10.a.b.254/24) in namespace P-sw
    ...                                            ┘

The switch namespace ``P-sw`` holds the bridge; the launcher's rendezvous server listens
on the bridge's address.
"""

import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: Every namespace this module creates starts with this (``cleanup`` looks for it).
NAME_PREFIX = "hvdqc-"
#: Where ``ip netns exec NS`` finds per-namespace files to bind over ``/etc`` (ip-netns(8)).
ETC_NETNS = Path("/etc/netns")
#: Where running clusters record their owner process (for ``cleanup``).
STATE_DIR = Path("/run/hvd_quant_cluster")
#: Private range the cluster subnets (/24) are drawn from (RFC 1918).
ADDRESS_POOL = ipaddress.ip_network("10.0.0.0/8")
#: Device names inside the namespaces (never visible in the root namespace).
HOST_DEV, BRIDGE_DEV = "eth0", "br0"

_COMMAND_TIMEOUT = 30


class ClusterUnavailable(RuntimeError):
    """This machine cannot run an emulated cluster (not root, no ``ip``/``tc``, no netns).

    The message says which requirement is missing and what to do.
    """


class ClusterError(RuntimeError):
    """Setting up or driving the emulated cluster failed (a command returned an error)."""


# --- rates and delays ------------------------------------------------------------------------
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_DELAY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate):
    """Bits per second of ``rate`` (``"100mbit"``, ``"1gbit"``, ``"10gbit"``, ``2.5e9``);
    ``None``, ``0``, ``""`` or ``"unlimited"`` mean no shaping (returns ``None``).

    ``tc``'s own ``bps`` suffix means *bytes* per second; that is accepted (and converted)
    because it is what tc(8) means, but bit rates are what the rest of the project uses.
    """
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("", "unlimited", "none")):
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if rate < 0:
            raise ValueError(f"link rate must be >= 0, got {rate!r}")
        return float(rate) or None
    m = _RATE.match(str(rate))
    if not m:
        raise ValueError(f"bad link rate {rate!r}: use e.g. 100mbit, 1gbit, 10gbit or 'unlimited'")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if (m.group(3) or "bit").lower() == "bps":
        value *= 8
    if value <= 0:
        raise ValueError(f"link rate must be > 0, got {rate!r} (use 'unlimited' for no shaping)")
    return value


def parse_delay(delay):
    """Seconds of ``delay`` (``"0.5ms"``, ``"1ms"``, ``"200us"``, ``0.001``); ``None`` or 0:
    no delay (returns 0.0). A bare number is seconds."""
    if delay is None or delay == "" or delay == 0:
        return 0.0
    if isinstance(delay, (int, float)) and not isinstance(delay, bool):
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay!r}")
        return float(delay)
    m = _DELAY.match(str(delay))
    if not m:
        raise ValueError(f"bad delay {delay!r}: use e.g. 500us, 1ms, 0.5ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[
        m.group(2).lower() if m.group(2) else None]


def format_rate(bits_per_second):
    """``1e9`` -> ``"1gbit"``, ``1e8`` -> ``"100mbit"``, ``None`` -> ``"unlimited"``."""
    if bits_per_second is None:
        return "unlimited"
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale and float(bits_per_second / scale).is_integer():
            return f"{int(bits_per_second / scale)}{suffix}"
    return f"{int(round(bits_per_second))}bit"


# --- running commands ------------------------------------------------------------------------
def run_cmd(args, check=True, timeout=_COMMAND_TIMEOUT, input=None):
    """Run one iproute2 command; raise :class:`ClusterError` with its stderr on failure."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError as exc:
        raise ClusterUnavailable(f"{args[0]!r} not found: {exc}") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"command timed out after {timeout}s: {' '.join(args)}") from None
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed (exit {proc.returncode}): {' '.join(args)}\n"
                           f"{proc.stderr.strip()}")
    return proc


# --- requirements ----------------------------------------------------------------------------
def requirement_problems(ip="ip", tc="tc"):
    """Why this machine cannot run the cluster: a list of messages, empty when it can.

    Checks are cheap and side-effect free: root, the ``ip`` and ``tc`` executables (found
    on ``PATH``), and a kernel with network namespaces (``/proc/self/ns/net``).
    :func:`probe` goes further and really creates a shaped link.
    """
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: network namespaces, veth links and tc qdiscs need root "
                        "(CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root, e.g. with sudo")
    for tool, package in ((ip, "iproute2"), (tc, "iproute2")):
        if shutil.which(tool) is None:
            problems.append(f"{tool!r} not found on PATH: install {package} "
                            "(apt-get install iproute2)")
    if not Path("/proc/self/ns/net").exists():
        problems.append("this kernel has no network namespaces (/proc/self/ns/net is missing; "
                        "needs CONFIG_NET_NS)")
    return problems


def check_requirements(ip="ip", tc="tc"):
    """Raise :class:`ClusterUnavailable` listing every missing requirement."""
    problems = requirement_problems(ip, tc)
    if problems:
        raise ClusterUnavailable("cannot run an emulated cluster here:\n  - " + "\n  - ".join(problems))


def probe():
    """Create and remove one shaped veth pair between two throw-away namespaces.

    Returns ``(problems, notes)``: ``problems`` lists what stops the cluster from running
    (empty: netns, veth, bridge and tbf work); ``notes`` lists optional features that are
    missing (netem, needed only for ``delay``). Never leaves anything behind.
    """
    problems = requirement_problems()
    if problems:
        return problems, []
    notes = []
    prefix = new_prefix()
    a, b = f"{prefix}probe-a", f"{prefix}probe-b"
    try:
        for ns in (a, b):
            run_cmd(["ip", "netns", "add", ns])
        required = [
            (["ip", "-n", a, "link", "add", "p0", "type", "veth", "peer", "name", HOST_DEV, "netns", b],
             "veth links (CONFIG_VETH)"),
            (["ip", "-n", a, "link", "add", BRIDGE_DEV, "type", "bridge"], "bridges (CONFIG_BRIDGE)"),
            (["tc", "-n", b, "qdisc", "add", "dev", HOST_DEV, "root", "handle", "1:", "tbf", "rate",
              "1gbit", "burst", "128kb", "latency", "100ms"], "tc tbf (CONFIG_NET_SCH_TBF)"),
        ]
        for args, what in required:
            proc = run_cmd(args, check=False)
            if proc.returncode != 0:
                problems.append(f"{what} do not work here: {' '.join(args)}: {proc.stderr.strip()}")
                break
        if not problems and not netem_available(b):
            notes.append(NETEM_MISSING)
    except (ClusterError, ClusterUnavailable) as exc:
        problems.append(f"cannot create network namespaces: {exc}")
    finally:
        for ns in (a, b):
            delete_namespace(ns)
    return problems, notes


NETEM_MISSING = ("tc netem is not available in this kernel (CONFIG_NET_SCH_NETEM): links can be "
                 "rate-limited but not delayed (delay must be 0)")


def netem_available(netns):
    """Whether ``tc netem`` works (tried on ``lo`` of ``netns``, then removed)."""
    proc = run_cmd(["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem",
                    "delay", "1ms"], check=False)
    run_cmd(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return proc.returncode == 0


# --- names and addresses ---------------------------------------------------------------------
def new_prefix():
    """A fresh, unique cluster prefix such as ``hvdqc-3fa9c1-`` (random, checked unused)."""
    existing = set(list_namespaces())
    while True:
        prefix = f"{NAME_PREFIX}{random.getrandbits(24):06x}-"
        if not any(ns.startswith(prefix) for ns in existing):
            return prefix


def list_namespaces():
    """Names of all network namespaces known to ``ip netns`` (``/run/netns``)."""
    proc = run_cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def networks_in_use(namespaces=()):
    """IPv4 networks routed or assigned in the root namespace and in ``namespaces``.

    Used to pick a cluster subnet that cannot shadow or be confused with any route the
    machine has (including other clusters' namespaces, listed in ``namespaces``).
    """
    nets = []
    sources = [[]] + [["-n", ns] for ns in namespaces]
    for where in sources:
        routes = run_cmd(["ip", *where, "-j", "-4", "route", "show", "table", "all"], check=False)
        for r in _json_list(routes.stdout):
            dst = r.get("dst")
            if dst and dst != "default":
                try:
                    nets.append(ipaddress.ip_network(dst, strict=False))
                except ValueError:
                    pass
        addrs = run_cmd(["ip", *where, "-j", "-4", "addr", "show"], check=False)
        for link in _json_list(addrs.stdout):
            for a in link.get("addr_info", []):
                if a.get("local"):
                    nets.append(ipaddress.ip_network(f"{a['local']}/{a.get('prefixlen', 32)}",
                                                     strict=False))
    return nets


def pick_subnet(in_use, rng=random):
    """A random ``10.x.y.0/24`` that overlaps none of ``in_use`` (:func:`networks_in_use`)."""
    for _ in range(1000):
        candidate = ipaddress.ip_network(f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(candidate.overlaps(n) for n in in_use):
            return candidate
    raise ClusterError("no free 10.x.y.0/24 subnet found for the emulated cluster")


def _json_list(text):
    try:
        value = json.loads(text or "[]")
    except json.JSONDecodeError:
        return []
    return value if isinstance(value, list) else []


# --- building and removing -------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its address on the cluster subnet, its index."""
    index: int
    name: str        # h0, h1, ... (Horovod's HOROVOD_HOSTNAME)
    netns: str       # e.g. hvdqc-3fa9c1-h0
    address: str     # e.g. 10.17.4.1
    port: str        # the switch-side veth end, p0, p1, ...


def create_topology(prefix, hosts, subnet, mtu=1500):
    """Create the switch namespace, one namespace per host and their veth links (unshaped).

    Returns ``(switch_netns, bridge_address, [Host])``. On failure, whatever was created
    stays for the caller's :func:`remove_cluster` (which removes everything by prefix).
    """
    switch = f"{prefix}sw"
    addresses = list(subnet.hosts())
    bridge_address = str(addresses[-1])
    run_cmd(["ip", "netns", "add", switch])
    run_cmd(["ip", "-n", switch, "link", "set", "lo", "up"])
    run_cmd(["ip", "-n", switch, "link", "add", BRIDGE_DEV, "type", "bridge"])
    run_cmd(["ip", "-n", switch, "addr", "add", f"{bridge_address}/{subnet.prefixlen}", "dev", BRIDGE_DEV])
    run_cmd(["ip", "-n", switch, "link", "set", BRIDGE_DEV, "up"])
    out = []
    for i in range(hosts):
        host = Host(i, f"h{i}", f"{prefix}h{i}", str(addresses[i]), f"p{i}")
        run_cmd(["ip", "netns", "add", host.netns])
        run_cmd(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        # Created inside the switch namespace with its peer placed straight into the host's:
        # neither end ever appears in the root namespace.
        run_cmd(["ip", "-n", switch, "link", "add", host.port, "mtu", str(mtu), "type", "veth",
                 "peer", "name", HOST_DEV, "mtu", str(mtu), "netns", host.netns])
        run_cmd(["ip", "-n", switch, "link", "set", host.port, "master", BRIDGE_DEV])
        run_cmd(["ip", "-n", switch, "link", "set", host.port, "up"])
        run_cmd(["ip", "-n", host.netns, "addr", "add", f"{host.address}/{subnet.prefixlen}",
                 "dev", HOST_DEV])
        run_cmd(["ip", "-n", host.netns, "link", "set", HOST_DEV, "up"])
        out.append(host)
    return switch, bridge_address, out


def write_hosts_file(host, hosts, hostname):
    """``/etc/netns/<ns>/hosts``, which ``ip netns exec`` binds over ``/etc/hosts``.

    Horovod 0.28.1 builds the Gloo contexts of process sets from the machine's hostname
    instead of ``HOROVOD_GLOO_IFACE`` (see ``shared/notes/platform.md``); mapping the
    hostname to this namespace's own address makes them connect over the emulated link.
    The ``h<i>`` names of all hosts are listed too, for convenience.
    """
    directory = ETC_NETNS / host.netns
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
             f"{host.address} {hostname} {host.name}"]
    lines += [f"{h.address} {h.name}" for h in hosts if h.index != host.index]
    (directory / "hosts").write_text("\n".join(lines) + "\n")


def shape_link(netns, dev, rate_bps, delay_s=0.0):
    """Replace the egress qdisc of ``dev`` in ``netns``: token bucket at ``rate_bps``, after a
    netem delay of ``delay_s`` when non-zero. ``rate_bps=None`` and no delay: no shaping.

    tbf (tc-tbf(8)): ``burst`` is the larger of 128 KB and 1 ms at the rate (it must hold a
    64 KB GSO segment; at 10 Gbit/s a 1 ms bucket keeps the timer cost low); ``latency
    100ms`` bounds the queue. netem (tc-netem(8)) is the root with tbf as its child, the
    order tc-netem(8) documents for delay plus rate; its ``limit`` is raised from 1000
    packets so that a full bandwidth-delay product fits at 10 Gbit/s.
    """
    run_cmd(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
    tbf = []
    if rate_bps:
        burst = max(128 * 1024, int(rate_bps / 8 * 1e-3))
        tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms"]
    if delay_s > 0:
        proc = run_cmd(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000"], check=False)
        if proc.returncode != 0:
            if "unknown" in proc.stderr.lower():
                raise ClusterUnavailable(NETEM_MISSING)
            raise ClusterError(f"tc netem failed on {dev} in {netns}: {proc.stderr.strip()}")
        if tbf:
            run_cmd(["tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
    elif tbf:
        run_cmd(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])


def namespace_pids(netns):
    """Pids of processes running in ``netns`` (``ip netns pids``)."""
    proc = run_cmd(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_namespace_processes(netns, grace=2.0):
    """SIGTERM, then SIGKILL after ``grace`` seconds, every process left in ``netns``.

    Only called on namespaces this module created: whatever runs there was started by
    the cluster (its ranks, its rendezvous server)."""
    pids = namespace_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie counts as gone (its parent will reap it; it holds no namespace resources).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def delete_namespace(netns):
    """Remove ``netns`` and its ``/etc/netns`` directory; a missing one is not an error.
    Links inside it (both veth ends are in our namespaces) go with it."""
    run_cmd(["ip", "netns", "delete", netns], check=False)
    directory = ETC_NETNS / netns
    if directory.is_dir():
        shutil.rmtree(directory, ignore_errors=True)


def remove_cluster(prefix):
    """Kill the processes in, and delete, every namespace whose name starts with ``prefix``;
    remove its ``/etc/netns`` directories and its state file. Returns the removed names."""
    names = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    if ETC_NETNS.is_dir():
        names += [d.name for d in ETC_NETNS.iterdir() if d.name.startswith(prefix) and d.name not in names]
    for ns in names:
        kill_namespace_processes(ns)
    for ns in names:
        delete_namespace(ns)
    state = state_file(prefix)
    if state.exists():
        state.unlink()
    return names


# --- ownership records (for cleanup of crashed runs) -----------------------------------------
def state_file(prefix):
    return STATE_DIR / f"{prefix.rstrip('-')}.json"


def record_owner(prefix, info):
    """Write ``{"pid": <this process>, ...info}`` so :func:`leftover_clusters` can tell a
    running cluster from the leftovers of a crashed one."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    state_file(prefix).write_text(json.dumps({"pid": os.getpid(), "prefix": prefix, **info}))


def leftover_clusters(name_prefix=NAME_PREFIX):
    """``{cluster_prefix: owner_pid_or_None}`` of clusters whose namespaces, ``/etc/netns``
    directories or state files exist and whose names start with ``name_prefix``."""
    found = {}
    pattern = re.compile(re.escape(NAME_PREFIX) + r"[0-9a-f]{6}-")
    names = list_namespaces()
    if ETC_NETNS.is_dir():
        names += [d.name for d in ETC_NETNS.iterdir()]
    if STATE_DIR.is_dir():
        names += [f.stem + "-" for f in STATE_DIR.glob("*.json")]
    for name in names:
        m = pattern.match(name)
        if m and name.startswith(name_prefix):
            found.setdefault(m.group(0), None)
    for prefix in found:
        try:
            found[prefix] = int(json.loads(state_file(prefix).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return found


def owner_alive(pid):
    return pid is not None and _alive(pid)
