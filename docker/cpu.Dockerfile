# qos-serve on CPU: the router, every scheduler (pure Python, no torch) and CPU workers.
#   docker build -f docker/cpu.Dockerfile -t qos-serve:cpu .
# torch 2.13.0 comes from PyTorch's CPU wheel index (PyPI's build for x86_64 is the CUDA one, GBs
# larger); every other pin from requirements.txt. The default model is converted at build time.
#
# Build arguments, for a machine that cannot reach Docker Hub or PyTorch's index
# (scripts/local_base_image.sh makes such a base from Debian's packages and passes them):
#   BASE_IMAGE       an image with Python 3.11 (`python3`, its venv module), gcc and libc6-dev
#   TORCH_INDEX_URL  where torch comes from; empty: from the wheels in docker/wheels/ or the index
#   PIP_INDEX_URL    the Python package index (default: PyPI)
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple

# A virtual environment: the same layout on python:* images and on Debian's own Python (which
# refuses system-wide pip installs).
ENV PYTHONUNBUFFERED=1 \
    QOS_SERVE_CACHE=/opt/qos-serve/cache \
    HF_HUB_OFFLINE=1 \
    PATH=/opt/qos-serve/venv/bin:$PATH

# gcc: the CPU worker's paged decode attention kernel is compiled at build time (docker/install.sh).
RUN if ! command -v cc >/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/qos-serve/venv

WORKDIR /opt/qos-serve/src
# Dependencies first: this layer is rebuilt only when the pins change.
COPY requirements.txt ./
COPY docker/install.sh docker/
COPY docker/wheels/ /tmp/wheels/
RUN PIP_INDEX_URL=${PIP_INDEX_URL} PIP_FIND_LINKS=/tmp/wheels sh docker/install.sh deps "${TORCH_INDEX_URL}" \
    && rm -rf /tmp/wheels
# The project, not the whole context: docker/wheels/ may hold a 180 MB torch wheel.
COPY pyproject.toml ./
COPY configs/ configs/
COPY services/ services/
COPY docker/install.sh docker/npu-entrypoint.sh docker/
RUN PIP_INDEX_URL=${PIP_INDEX_URL} sh docker/install.sh app

USER qos
WORKDIR /home/qos
ENTRYPOINT ["qos-serve"]
CMD ["--help"]
