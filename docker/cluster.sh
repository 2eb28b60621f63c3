#!/usr/bin/env bash
# A Horovod cluster of containers with plain `podman run` / `docker run` (no compose needed):
#
#   docker/cluster.sh up            start WORKERS worker containers w1..wN on their own network
#   docker/cluster.sh run [CMD...]  run horovodrun across them from a launcher container
#                                   (default CMD: the example; see docker/cluster-run.sh)
#   docker/cluster.sh down          remove the cluster's containers, network and volume
#   docker/cluster.sh job [CMD...]  up + run + down, down on every exit path
#   docker/cluster.sh status        list the cluster's containers
#
# The same containers as docker/compose.yaml: the image's entrypoint, sshd on port 2222 as
# user hvd, the cluster's ssh key in a volume at /cluster, horovodrun -H w1:1,...,wN:1.
#   CLUSTER      name prefix of containers, network and volume (default hvdq)
#   WORKERS      number of workers, default 3        IMAGE  default localhost/hvd-quant:latest
#   LINK_RATE / LINK_DELAY   shape every container's egress (tc), e.g. 1gbit / 5ms
#   CLUSTER_DIR  a host directory to mount at /cluster instead of a volume (keys, results)
#   EXTERNAL=1   let the containers reach other networks; by default their network is
#                internal: they reach each other and nothing else
#   LAUNCHER     gloo (default: horovodrun --gloo) or mpi (mpirun; Horovod on MPI)
#   Passed to the launcher: LAUNCHER EXAMPLE COMPRESSION EPOCHS EXAMPLE_ARGS JOB_TIMEOUT WAIT_S HOROVOD_*
set -euo pipefail
. "$(dirname "$0")/engine.sh"
CLUSTER=${CLUSTER:-hvdq}
WORKERS=${WORKERS:-3}
IMAGE=${IMAGE:-localhost/hvd-quant:latest}
label="hvdq.cluster=$CLUSTER"
net="$CLUSTER-net"
[[ $CLUSTER =~ ^[a-z0-9][a-z0-9_.-]*$ ]] || die "CLUSTER must be a lower-case name, not '$CLUSTER'"
[[ $WORKERS =~ ^[1-9][0-9]*$ ]] || die "WORKERS must be a positive integer, not '$WORKERS'"
e() { timeout 120 "$ENGINE" "$@"; }   # no engine call may hang the script
rmf() { if [ "$ENGINE" = podman ]; then e rm -f -t 0 "$@"; else e rm -f "$@"; fi; }

# Options every container gets: root only until the entrypoint has shaped the link.
common() {
    opts=(--label "$label" --network "$net" --user 0)
    if [ -n "${CLUSTER_DIR:-}" ]; then
        mkdir -p "$CLUSTER_DIR"
        opts+=(-v "$(cd "$CLUSTER_DIR" && pwd):/cluster")
    else
        opts+=(-v "$CLUSTER-keys:/cluster")
    fi
    if [ -n "${LINK_RATE:-}${LINK_DELAY:-}" ]; then
        opts+=(--cap-add NET_ADMIN -e "LINK_RATE=${LINK_RATE:-}" -e "LINK_DELAY=${LINK_DELAY:-}")
    fi
}

up() {
    local i
    e image inspect "$IMAGE" >/dev/null 2>&1 || die "no image $IMAGE: run docker/build.sh first"
    [ -z "$(e ps -aq --filter "label=$label")" ] || die "cluster '$CLUSTER' exists: '$0 down' first"
    local internal=(--internal)
    [ "${EXTERNAL:-0}" = 0 ] || internal=()
    e network create "${internal[@]}" --label "$label" "$net" >/dev/null
    [ -n "${CLUSTER_DIR:-}" ] || e volume create --label "$label" "$CLUSTER-keys" >/dev/null
    common
    for i in $(seq 1 "$WORKERS"); do
        e run -d --name "$CLUSTER-w$i" --hostname "w$i" --network-alias "w$i" \
            --network-alias worker "${opts[@]}" "$IMAGE" sshd >/dev/null
    done
    # A worker whose entrypoint failed (say, LINK_DELAY without netem) stops here, not
    # later as an ssh timeout.
    local log deadline=$((SECONDS + 60))
    for i in $(seq 1 "$WORKERS"); do
        until log=$(e logs "$CLUSTER-w$i" 2>&1); [[ $log == *"listening on port 2222"* ]]; do
            if [ "$(e inspect -f '{{.State.Running}}' "$CLUSTER-w$i")" != true ] || ((SECONDS > deadline)); then
                die "worker w$i did not start:"$'\n'"$log"
            fi
            sleep 0.5
        done
    done
    say "cluster '$CLUSTER': $WORKERS workers (w1..w$WORKERS) on network $net"
}

run() {
    local hosts env=() v
    hosts=$(seq 1 "$WORKERS" | sed 's/^/w/; s/$/:1/' | paste -sd, -)
    for v in LAUNCHER EXAMPLE COMPRESSION EPOCHS EXAMPLE_ARGS JOB_TIMEOUT WAIT_S $(compgen -e | grep '^HOROVOD_' || true); do
        [ -z "${!v+x}" ] || env+=(-e "$v=${!v}")
    done
    common
    # Not --rm: the exit status must survive a launcher that is killed; down removes it.
    rmf "$CLUSTER-launcher" >/dev/null 2>&1 || true
    "$ENGINE" run --name "$CLUSTER-launcher" --hostname launcher "${opts[@]}" \
        -e "WORKERS=$WORKERS" -e "HVD_HOSTS=$hosts" "${env[@]}" "$IMAGE" hvd-cluster-run "$@"
}

down() {
    local ids
    ids=$(e ps -aq --filter "label=$label")
    [ -z "$ids" ] || rmf $ids >/dev/null
    if e network inspect "$net" >/dev/null 2>&1; then e network rm "$net" >/dev/null; fi
    if e volume inspect "$CLUSTER-keys" >/dev/null 2>&1; then e volume rm "$CLUSTER-keys" >/dev/null; fi
    if [ -n "$(e ps -aq --filter "label=$label")" ]; then die "containers of '$CLUSTER' are left"; fi
    say "cluster '$CLUSTER' removed"
}

case ${1:-} in
    up) trap 'down' EXIT; up; trap - EXIT ;;   # a failed start leaves nothing behind
    run) shift; run "$@" ;;
    down) down ;;
    status) e ps -a --filter "label=$label" ;;
    job)
        shift
        trap 'down' EXIT
        trap 'exit 130' INT TERM
        up
        run "$@" ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
