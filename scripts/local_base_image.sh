#!/bin/sh
# A base image for docker/cpu.Dockerfile made from Debian's packages, for a machine that reaches
# Debian's mirror and a Python package index but no image registry (as this project's own CI).
#
#   scripts/local_base_image.sh [TAG]      (default TAG: qos-serve-base:bookworm; root, dockerd up)
#
# debootstrap a minimal bookworm (Python 3.11, its venv module, gcc, libc6-dev) from the mirror
# this machine's apt uses, give it this machine's CA bundle (so a TLS-inspecting proxy in front
# of the package index is trusted inside the build as it is here), and `docker import` it. Kept
# between runs: an existing TAG is reused (`docker rmi TAG` to make it again).
#
# Also puts this machine's torch CPU wheel, where pip finds one locally (its find-links folders),
# into docker/wheels/ for the build (pass --build-arg TORCH_INDEX_URL= to use it). Prints the
# build arguments to use.
set -eu

tag=${1:-qos-serve-base:bookworm}
here=$(cd "$(dirname "$0")/.." && pwd)

if ! docker image inspect "$tag" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
    # The first Debian mirror apt is configured with (deb822 .sources or a one-line sources.list).
    mirror=$(grep -hoE '^(URIs:|deb) +[a-z]+://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')
    [ -n "$mirror" ] || { echo "no Debian mirror found in /etc/apt" >&2; exit 1; }
    rootfs=$(mktemp -d /var/tmp/qos-base.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    echo "debootstrap bookworm into $rootfs (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,gcc,libc6-dev \
        bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
    rm -f "$rootfs.log"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
        -c 'ENV LANG=C.UTF-8' \
        -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        - "$tag" >/dev/null
    echo "made $tag"
else
    echo "$tag exists (docker rmi $tag to make it again)"
fi

# A torch CPU wheel pip would take from this machine's disk.
wheel=
for dir in $(python3 -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p") ${PIP_FIND_LINKS:-}; do
    for candidate in "$dir"/torch-2.13.0+cpu-cp311-*.whl; do
        [ -f "$candidate" ] && wheel=$candidate
    done
done
if [ -n "$wheel" ]; then
    cp -u "$wheel" "$here/docker/wheels/"
    echo "build with: --build-arg BASE_IMAGE=$tag --build-arg TORCH_INDEX_URL= (torch from docker/wheels/$(basename "$wheel"))"
else
    echo "build with: --build-arg BASE_IMAGE=$tag (torch from PyTorch's CPU index)"
fi
