#!/bin/sh
# hvd-cluster-run [COMMAND...]: run one horovodrun job across the cluster's workers.
#
# Runs in the launcher container (user hvd, cwd /opt/hvd_quant). horovodrun starts one
# rank per worker over ssh (port 2222, the key in /cluster), the conventional Horovod way:
#     horovodrun -np 3 -H w1:1,w2:1,w3:1 --gloo --network-interfaces eth0 COMMAND
# or, with LAUNCHER=mpi, OpenMPI's mpirun does (its daemons over the same ssh), Horovod on MPI:
#     mpirun -np 3 -H w1:1,w2:1,w3:1 --mca btl_tcp_if_include eth0 ... -x PATH ... COMMAND
#   LAUNCHER      gloo (default) or mpi
#   WORKERS       number of workers (ranks), default 3
#   HVD_HOSTS     host list, e.g. w1:1,w2:1,w3:1; default: the addresses of DNS name "worker"
#                 (compose's replicas all answer to their service name)
#   WAIT_S        how long to wait for workers and their sshd (default 90)
#   JOB_TIMEOUT   kill the job after this many seconds (default: none)
# Without COMMAND it runs the example: python examples/$EXAMPLE --compression $COMPRESSION
# --epochs $EPOCHS $EXAMPLE_ARGS (defaults pytorch_train.py, marsit, 5).
set -eu
log() { echo "[hvd-cluster-run] $*" >&2; }
np=${WORKERS:-3}
hosts=${HVD_HOSTS:-}
deadline=$(( $(date +%s) + ${WAIT_S:-90} ))
late() { [ "$(date +%s)" -ge "$deadline" ]; }

if [ -z "$hosts" ]; then
    # Sorted so that ranks map to workers the same way on every run.
    while addrs=$(getent ahostsv4 worker | awk '{print $1}' | sort -u -V); \
          [ "$(printf '%s\n' "$addrs" | grep -c .)" -lt "$np" ]; do
        late && { log "found $(printf '%s\n' "$addrs" | grep -c .) of $np workers named 'worker' after ${WAIT_S:-90}s"; exit 2; }
        sleep 1
    done
    hosts=$(printf '%s\n' "$addrs" | head -n "$np" | sed 's/$/:1/' | paste -sd, -)
fi

for h in $(echo "$hosts" | tr , ' '); do
    until ssh "${h%%:*}" true 2>/dev/null; do
        late && { log "worker ${h%%:*}: no ssh on port 2222 after ${WAIT_S:-90}s ($(ssh "${h%%:*}" true 2>&1 | tail -1))"; exit 2; }
        sleep 1
    done
done

[ $# -gt 0 ] || set -- python "examples/${EXAMPLE:-pytorch_train.py}" \
    --compression "${COMPRESSION:-marsit}" --epochs "${EPOCHS:-5}" ${EXAMPLE_ARGS:-}
dev=$(ip -o -4 addr show scope global | awk '{print $2; exit}')  # the cluster network's interface
case ${LAUNCHER:-gloo} in
    gloo) set -- horovodrun -np "$np" -H "$hosts" --gloo --network-interfaces "$dev" "$@" ;;
    mpi)
        # The ranks' environment goes on mpirun's command line (ssh starts the daemons with
        # sshd's bare environment): the image's PATH and the Horovod settings given.
        xs=""
        for v in $(env | sed -n 's/^\(HOROVOD_[A-Za-z0-9_]*\)=.*/\1/p'); do xs="$xs -x $v"; done
        # shellcheck disable=SC2086
        set -- mpirun -np "$np" -H "$hosts" --bind-to none --map-by slot --mca pml ob1 \
            --mca btl ^openib --mca btl_tcp_if_include "$dev" --mca oob_tcp_if_include "$dev" \
            -x PATH -x PYTHONUNBUFFERED -x TF_CPP_MIN_LOG_LEVEL $xs "$@" ;;
    *) log "LAUNCHER must be gloo or mpi, not '$LAUNCHER'"; exit 2 ;;
esac
log "$*"
rc=0
${JOB_TIMEOUT:+timeout -k 10 "$JOB_TIMEOUT"} "$@" || rc=$?
# A worker is reported unreachable only when three probes, 1 s apart, all fail: just after
# a failed job the live workers are busy tearing their ranks down, and on a loaded machine
# one 3 s probe of a live worker was seen to fail ("unreachable workers: w1 w2").
reachable() {
    for _ in 1 2 3; do
        timeout 15 ssh -o ConnectTimeout=5 -o BatchMode=yes "$1" true 2>/dev/null && return 0
        sleep 1
    done
    return 1
}
if [ "$rc" -ne 0 ]; then
    down=""
    for h in $(echo "$hosts" | tr , ' '); do
        reachable "${h%%:*}" || down="$down ${h%%:*}"
    done
    [ "$rc" -eq 124 ] && log "job killed after JOB_TIMEOUT=${JOB_TIMEOUT}s"
    log "job failed (exit $rc); ${down:+unreachable workers:$down; }see the rank output above"
fi
exit "$rc"
