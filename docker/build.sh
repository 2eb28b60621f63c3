#!/usr/bin/env bash
# Build the hvd_quant image with podman or docker:  docker/build.sh [extra build args...]
#
#   IMAGE        the tag (default localhost/hvd-quant:latest)
#   BASE         a Debian bookworm base image. Default with docker: debian:bookworm-slim.
#                Default with podman: localhost/hvd-quant-base:bookworm, made here once with
#                debootstrap when no registry is reachable (kept as a cache; ~30 s to make)
#   TORCH_INDEX  pip index with torch's CPU build, used when no local CPU wheel was found
#                (default https://download.pytorch.org/whl/cpu)
#   HVD_QUANT_CACHE  the Horovod wheel cache of scripts/build_horovod.sh (~/.cache/hvd_quant)
#   DEPS_IMAGE   also tag the dependency stage under this name: a cache that keeps the
#                dependency layers (minutes to rebuild) when IMAGE is removed
#
# Before building it fills docker/wheels/ (git-ignored; mounted into the dependency step,
# never copied into the image): torch's CPU wheel when pip finds one without an index
# (a local find-links, as on this project's machines), the cached Horovod wheels, and the
# versions of .venv as pip constraints, so the image matches the host environment, and the
# host's CA bundle for the build's downloads.
set -euo pipefail
. "$(dirname "$0")/engine.sh"
IMAGE=${IMAGE:-localhost/hvd-quant:latest}
wheels="$root/docker/wheels"
start=$SECONDS

# --- base image -----------------------------------------------------------------------
make_base() {  # debootstrap a minimal bookworm and import it (no registry needed)
    local name=$1 dir
    command -v debootstrap >/dev/null || die "no base image '$name' and no debootstrap to make one (apt-get install debootstrap), or set BASE"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root; or set BASE to a Debian bookworm image"
    dir=$(mktemp -d /var/tmp/hvdq-base.XXXXXX)
    trap 'rm -rf "$dir"' EXIT
    say "making base image $name with debootstrap (about 30 s)"
    timeout 900 debootstrap --variant=minbase bookworm "$dir" http://deb.debian.org/debian >"$dir.log" 2>&1 \
        || { tail -20 "$dir.log" >&2; rm -f "$dir.log"; die "debootstrap failed"; }
    rm -f "$dir.log" "$dir"/var/cache/apt/archives/*.deb
    cat >"$dir/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    tar -C "$dir" -c . | timeout 300 podman import --change 'CMD ["/bin/bash"]' - "$name" >/dev/null
    rm -rf "$dir"
    trap - EXIT
}
if [ -z "${BASE:-}" ]; then
    if [ "$ENGINE" = podman ]; then
        BASE=localhost/hvd-quant-base:bookworm
        podman image exists "$BASE" || make_base "$BASE"
    else
        BASE=docker.io/library/debian:bookworm-slim
    fi
fi

# --- wheels ------------------------------------------------------------------------------
py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
mkdir -p "$wheels"
if command -v flock >/dev/null 2>&1; then  # one build at a time fills docker/wheels/
    exec 9>"$wheels/.lock"
    flock -w 1800 9 || die "another build.sh has held $wheels/.lock for 30 minutes"
fi
if ! ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    # --no-index: only the configured find-links, i.e. a local copy; never PyPI's CUDA build.
    "$py" -m pip download --quiet --no-deps --no-index --only-binary :all: -d "$wheels" torch==2.13.0 \
        2>/dev/null || true
    for f in "$wheels"/torch-2.13.0*.whl; do
        case $f in *+cpu-*) ;; *) rm -f "$f" ;; esac
    done
fi
if ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    say "torch: $(basename "$wheels"/torch-2.13.0+cpu-*.whl) (local)"
    TORCH_INDEX=""
else
    TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    say "torch: no local CPU wheel; the image build takes it from $TORCH_INDEX"
fi

cache=${HVD_QUANT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_quant}
rm -rf "$wheels/hvd_quant-cache"
if ls "$cache"/wheels/horovod-*/horovod-*.whl >/dev/null 2>&1; then
    mkdir -p "$wheels/hvd_quant-cache"
    cp -al "$cache/wheels" "$wheels/hvd_quant-cache/" 2>/dev/null || cp -r "$cache/wheels" "$wheels/hvd_quant-cache/"
    say "horovod: prebuilt $(cd "$cache/wheels" && ls -d horovod-*/ | tr -d / | paste -sd' ' -)"
else
    say "horovod: no cached wheel in $cache; the image build compiles it (5-10 minutes, kept in a build cache)"
fi

# The build's downloads trust what the host trusts (a proxy's CA, say); mounted, not copied in.
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
if [ -s "$ca" ]; then
    cmp -s "$ca" "$wheels/ca-bundle.pem" || cp "$ca" "$wheels/ca-bundle.pem"
else
    rm -f "$wheels/ca-bundle.pem"
fi

if [ -x "$root/.venv/bin/python" ]; then
    # Same versions as the host environment; local builds and editables are not pins.
    "$root/.venv/bin/python" -m pip freeze --exclude-editable 2>/dev/null \
        | grep -v -e ' @ ' -e '^horovod==' -e '^hvd[-_]quant' > "$wheels/constraints.tmp" || true
    cmp -s "$wheels/constraints.tmp" "$wheels/constraints.txt" \
        && rm "$wheels/constraints.tmp" || mv "$wheels/constraints.tmp" "$wheels/constraints.txt"
fi

# --- build -------------------------------------------------------------------------------
args=(build -f "$root/docker/Dockerfile" --build-arg "BASE=$BASE" --build-arg "TORCH_INDEX=$TORCH_INDEX")
[ "$ENGINE" = podman ] && args+=(--layers --ignorefile "$root/docker/Dockerfile.dockerignore")
if [ -n "${DEPS_IMAGE:-}" ]; then
    old=$("$ENGINE" image inspect -f '{{.Id}}' "$DEPS_IMAGE" 2>/dev/null || true)
    say "dependency stage -> $DEPS_IMAGE"
    "$ENGINE" "${args[@]}" -t "$DEPS_IMAGE" --target deps "$@" "$root"
    new=$("$ENGINE" image inspect -f '{{.Id}}' "$DEPS_IMAGE")
    # The stage it replaced (4 GB) goes, unless something still uses it.
    if [ -n "$old" ] && [ "$old" != "$new" ]; then "$ENGINE" rmi "$old" >/dev/null 2>&1 || true; fi
fi
say "$ENGINE ${args[*]} -t $IMAGE $* $root"
"$ENGINE" "${args[@]}" -t "$IMAGE" "$@" "$root"
say "built $IMAGE in $((SECONDS - start)) s"
