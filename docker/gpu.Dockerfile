# qos-serve on NVIDIA GPUs: the GPU worker (torch 2.13.0, PyPI's CUDA build) plus the `gpu` extra
# (nvidia-ml-py, for utilization from NVML).
#   docker build -f docker/gpu.Dockerfile -t qos-serve:gpu .
# The CUDA user-space libraries come with torch's wheels (CUDA 13.0 for torch 2.13), so the
# `base` flavour is enough; the host needs an NVIDIA driver for CUDA 13 and the NVIDIA Container
# Toolkit. Set CUDA_IMAGE to a `-runtime-` tag for the full CUDA runtime libraries.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu22.04
FROM ${CUDA_IMAGE}

# Python 3.11 from the deadsnakes PPA (Ubuntu 22.04 ships 3.10), in a virtualenv.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates python3.11 python3.11-venv \
    && apt-get purge -y --auto-remove software-properties-common \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    QOS_SERVE_CACHE=/opt/qos-serve/cache \
    HF_HUB_OFFLINE=1

WORKDIR /opt/qos-serve/src
COPY requirements.txt ./
COPY docker/install.sh docker/
RUN sh docker/install.sh deps
COPY . .
RUN sh docker/install.sh app gpu

USER qos
WORKDIR /home/qos
ENTRYPOINT ["qos-serve"]
CMD ["--help"]
