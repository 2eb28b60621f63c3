#!/usr/bin/env bash
# Run a command in a private network namespace whose loopback is rate-limited, so that
# ranks launched with `horovodrun -H localhost:N` talk over an emulated slow link.
#
#   sudo benchmarks/slow_link.sh 1gbit .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \
#       .venv/bin/python benchmarks/bench_allreduce.py --sizes 16000000
#
# Needs root and iproute2 (ip, tc). All traffic of the job (both directions, all ranks)
# shares the one token bucket. The namespace is removed on exit, also on failure.
set -euo pipefail
rate=${1:?usage: slow_link.sh RATE COMMAND... (RATE like 1gbit, 100mbit)}
shift
ns=hvdq_slow_$$
cleanup() { ip netns delete "$ns" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 1mb latency 100ms
echo "[slow_link] loopback limited to $rate in namespace $ns" >&2
ip netns exec "$ns" "$@"
