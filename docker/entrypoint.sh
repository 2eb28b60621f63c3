#!/bin/sh
# Entrypoint of every hvd_quant cluster container (workers and the launcher).
#
#   started as root : apply the optional link shaper (tc needs CAP_NET_ADMIN and root),
#                     hand /cluster to user hvd, then re-run this script as hvd;
#   as hvd          : join the cluster's ssh key (shared through /cluster), then run
#                     "sshd" (a worker) or the given command (the launcher, or anything).
#
# Nothing but the tc call runs as root: sshd runs as hvd on port 2222 and can only log
# hvd in, which is all horovodrun needs.
#   LINK_RATE   e.g. 1gbit, 100mbit: egress rate of this container (tbf, or netem with delay)
#   LINK_DELAY  e.g. 5ms: added egress delay (needs the kernel's sch_netem)
set -eu
log() { echo "[hvd-entrypoint $(hostname)] $*" >&2; }

if [ "$(id -u)" = 0 ]; then
    if [ -n "${LINK_RATE:-}${LINK_DELAY:-}" ]; then
        dev=$(ip -o -4 addr show scope global | awk '{print $2; exit}')  # the cluster network's interface
        if [ -n "${LINK_DELAY:-}" ]; then
            # netem does both; a kernel without sch_netem answers "qdisc kind is unknown".
            tc qdisc replace dev "$dev" root netem delay "$LINK_DELAY" ${LINK_RATE:+rate "$LINK_RATE"} \
                || { log "cannot add a delay: this kernel has no netem qdisc (LINK_RATE alone works with tbf)"; exit 1; }
        else
            # A 256 KiB bucket lets tbf reach rates up to a few Gbit/s.
            tc qdisc replace dev "$dev" root tbf rate "$LINK_RATE" burst 256kb latency 100ms
        fi
        log "shaped $dev: $(tc qdisc show dev "$dev" | head -1)"
    fi
    chown hvd:hvd /cluster 2>/dev/null || true
    exec setpriv --reuid=hvd --regid=hvd --init-groups \
        env HOME=/home/hvd USER=hvd LOGNAME=hvd "$0" "$@"
fi

# --- as user hvd ------------------------------------------------------------------
umask 077
key=/cluster/id_ed25519
if [ ! -s "$key" ]; then
    # Every container may get here at once: each writes its own key, the first link wins.
    tmp=/cluster/.key.$(hostname).$$
    ssh-keygen -q -t ed25519 -N '' -C hvd-cluster -f "$tmp"
    ln "$tmp" "$key" 2>/dev/null || true
    rm -f "$tmp" "$tmp.pub"
fi
mkdir -p "$HOME/.ssh"
ssh-keygen -y -f "$key" > "$HOME/.ssh/authorized_keys"

if [ "${1:-sshd}" = sshd ]; then
    [ -s "$HOME/.ssh/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$HOME/.ssh/host_ed25519"
    log "sshd (user hvd) listening on port 2222"
    exec /usr/sbin/sshd -D -e -f /etc/ssh/hvd_sshd_config
fi
exec "$@"
