# syntax=docker/dockerfile:1
# memstore image: the store (`memstore serve`, the default command), the CLI, trainer_client and CPU torch.
#   docker build -t ghcr.io/memstore/memstore:0.1.0 .
# Base images are pinned to a patch version; bump them deliberately (and the tag in k8s/base/kustomization.yaml).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- builder: a virtual environment with memstore and its pinned dependencies -----------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# CPU torch from PyTorch's index, the version requirements/dev.lock pins: the store imports torch only to export
# spilled DCP steps (and `memstore export`), trainers built on this image use it for training. A GPU training image
# installs its own CUDA torch and memstore on top.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY requirements/dev.lock requirements/dev.lock
COPY pyproject.toml README.md ./
COPY memstore memstore
COPY trainer_client trainer_client
# Every other dependency at the version CI tested (the lock is a constraints file: it pins, it adds nothing);
# s3fs for --spill s3://..., pyeclib for --redundancy ec:K+M with M >= 2.
RUN pip install --constraint requirements/dev.lock ".[s3,erasure]" \
 && memstore --help >/dev/null

# --- runtime: the venv, the examples, a non-root user -------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# No .pyc writes at run time: pods run with a read-only root filesystem (pip compiled the bytecode at install).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# uid/gid 10001: the store's shared-memory segments are mode 0600, so trainers that use the local fast path run as
# this uid too (runAsUser in k8s/).
RUN groupadd --system --gid 10001 memstore \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin memstore
COPY --from=builder /opt/venv /opt/venv
COPY examples /opt/memstore/examples
USER 10001:10001
WORKDIR /tmp
# gRPC (hostPort on Kubernetes), data channel between stores, plaintext gRPC health.
EXPOSE 7070 7071 7072
ENTRYPOINT ["memstore"]
CMD ["serve"]
