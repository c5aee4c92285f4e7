# syntax=docker/dockerfile:1
# Two images from one project:
#   docker build --target operator -t ghcr.io/multiworld/operator .   the kopf controller; no torch
#   docker build --target worker   -t ghcr.io/multiworld/worker .     the worker library, CPU torch, examples
# The worker's torch comes from the index in TORCH_INDEX_URL (CPU wheels by default), so a CUDA
# image is a deliberate choice:
#   docker build --target worker --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .

ARG PYTHON_IMAGE=python:3.11-slim
# PIP_CERT (unset by default) names a CA bundle in the base image for pip to trust, for builds
# behind a TLS-intercepting proxy such as tests/cluster/images.py's. As a build arg it reaches the
# pip steps only, never the images' environment or pip configuration.

# The project as one wheel: the images install the wheel, not the source tree.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
ARG PIP_CERT
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# What both images share: no pip cache, unbuffered logs, an unprivileged user (uid 10001, the
# uid the Helm chart's securityContext expects).
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 multiworld \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin multiworld
WORKDIR /app

FROM runtime AS operator
ARG PIP_CERT
COPY --from=wheel /wheels /tmp/wheels
RUN pip install "$(ls /tmp/wheels/multiworld-*.whl)[operator]" && rm -rf /tmp/wheels
USER 10001:10001
ENTRYPOINT ["multiworld", "operator"]

FROM runtime AS worker
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_CERT
COPY --from=wheel /wheels /tmp/wheels
COPY constraints.txt /tmp/constraints.txt
# constraints.txt pins torch; the pinned version is taken from TORCH_INDEX_URL, whose local
# version (+cpu, +cu126, ...) sorts above PyPI's build of the same version.
RUN pip install -c /tmp/constraints.txt --extra-index-url "${TORCH_INDEX_URL}" \
        "$(ls /tmp/wheels/multiworld-*.whl)[worker]" \
    && rm -rf /tmp/wheels /tmp/constraints.txt
# `python examples/<name>/main.py` runs from the working directory.
COPY examples ./examples
USER 10001:10001
CMD ["python"]
