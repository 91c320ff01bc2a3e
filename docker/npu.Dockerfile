# qos-serve on Ascend NPUs: the NPU worker (torch 2.13.0 CPU build + the `npu` extra, torch_npu
# 2.13.0) on Ascend's public CANN image.
#   docker build -f docker/npu.Dockerfile -t qos-serve:npu .
# Base: quay.io/ascend/cann (also ascendai/cann on Docker Hub; Dockerfiles in
# github.com/Ascend/cann-container-image): CANN 9.1.0 toolkit, ops and NNAL for Atlas A2 (910B),
# Ubuntu 22.04, Python 3.11, for amd64 and arm64. torch_npu 2.13.0 needs a CANN 9.x; if Ascend's
# compatibility table pairs it with another CANN release, change CANN_IMAGE to match. The host
# provides the NPU driver and firmware (mounted by docker-compose.yml).
ARG CANN_IMAGE=quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

# TORCH_DEVICE_BACKEND_AUTOLOAD=0: `import torch` must not load torch_npu by itself (it fails at
# build time, where no driver is mounted); the NPU backend imports it, guarded, when asked for.
ENV PYTHONUNBUFFERED=1 \
    QOS_SERVE_CACHE=/opt/qos-serve/cache \
    HF_HUB_OFFLINE=1 \
    TORCH_DEVICE_BACKEND_AUTOLOAD=0

WORKDIR /opt/qos-serve/src
COPY requirements.txt ./
COPY docker/install.sh docker/
RUN sh docker/install.sh deps https://download.pytorch.org/whl/cpu
COPY . .
RUN sh docker/install.sh app npu \
    && install -m 0755 docker/npu-entrypoint.sh /usr/local/bin/qos-serve-npu

USER qos
WORKDIR /home/qos
ENTRYPOINT ["/usr/local/bin/qos-serve-npu"]
CMD ["--help"]
