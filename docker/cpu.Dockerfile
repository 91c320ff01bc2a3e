# qos-serve on CPU: the router, every scheduler (pure Python, no torch) and CPU workers.
#   docker build -f docker/cpu.Dockerfile -t qos-serve:cpu .
# torch 2.13.0 comes from PyTorch's CPU wheel index (PyPI's build for x86_64 is the CUDA one, GBs
# larger); every other pin from requirements.txt. The default model is converted at build time.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    QOS_SERVE_CACHE=/opt/qos-serve/cache \
    HF_HUB_OFFLINE=1

# gcc: the CPU worker's paged decode attention kernel is compiled at build time (docker/install.sh).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/qos-serve/src
# Dependencies first: this layer is rebuilt only when the pins change.
COPY requirements.txt ./
COPY docker/install.sh docker/
RUN sh docker/install.sh deps https://download.pytorch.org/whl/cpu
COPY . .
RUN sh docker/install.sh app

USER qos
WORKDIR /home/qos
ENTRYPOINT ["qos-serve"]
CMD ["--help"]
