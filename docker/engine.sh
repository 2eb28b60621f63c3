# Sourced by build.sh and cluster.sh: pick the container engine and its settings.
#   CONTAINER_ENGINE=podman|docker   default: podman when installed, else docker with a running engine
# Defines: root (the repository), ENGINE, die, say.
root=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "[$(basename "$0")] error: $*" >&2; exit 1; }
say() { echo "[$(basename "$0")] $*" >&2; }

ENGINE=${CONTAINER_ENGINE:-}
if [ -z "$ENGINE" ]; then
    if command -v podman >/dev/null 2>&1; then
        ENGINE=podman
    elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        ENGINE=docker
    else
        die "no container engine: install podman (Debian: apt-get install podman runc) or Docker"
    fi
fi
case $ENGINE in
    podman)
        if [ -z "${CONTAINERS_CONF:-}" ] && command -v runc >/dev/null 2>&1; then
            export CONTAINERS_CONF="$root/docker/containers.conf"
        fi ;;
    docker) export DOCKER_BUILDKIT=1 ;;   # RUN --mount needs BuildKit
    *) die "CONTAINER_ENGINE must be podman or docker, not '$ENGINE'" ;;
esac
command -v "$ENGINE" >/dev/null 2>&1 || die "CONTAINER_ENGINE=$ENGINE is not installed"
