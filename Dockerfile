# syntax=docker/dockerfile:1
#
# semif-serve: one image, one GPU (see stacks/semif/ and stacks/semif-multi/).
#
#   docker build -t semif-serve:0.2.0 .                        # with the fast kernels and the OpenTelemetry SDK
#   docker build -t semif-serve:0.2.0 --build-arg EXTRAS="" .  # without either
#
# Everything Python comes from uv.lock (`uv sync --frozen`): nothing is resolved here.
#
# The extras: the OpenTelemetry SDK (otel: traces stay off until OTEL_TRACES_EXPORTER=otlp) and
# the fast kernels (kernels): flash-linear-attention is pure triton, but
# causal-conv1d 1.7.0 is an sdist whose setup.py imports torch and runs nvcc -V at import time,
# even when it then only downloads a prebuilt wheel. So:
#   * the builder is the CUDA 12.8 *devel* image (nvcc matching torch's cu128 build);
#   * causal-conv1d is built with --no-build-isolation-package: an isolated build would install
#     the newest torch from PyPI and compile (or pick a prebuilt wheel) against the wrong torch
#     ABI. Built in place, it sees the locked torch 2.10.0+cu128, setuptools 84 (a torch
#     dependency on Python 3.12, which is why the image runs 3.12; its vendored `wheel` covers
#     setup.py's bdist_wheel import) and ninja (a locked dependency of causal-conv1d);
#   * CAUSAL_CONV1D_FORCE_BUILD=FALSE (default, as deployed in 0.1.3) lets setup.py fetch
#     upstream's prebuilt cu12/torch2.10 wheel from GitHub and compile only when that wheel is
#     missing; it needs GitHub reachable. TRUE always compiles from the hashed sdist here
#     (hermetic, no GitHub, ~10 min with MAX_JOBS=4). Re-run the acceptance if you switch.
# The runtime stage needs no CUDA toolkit (the torch wheel bundles its CUDA libraries), but it
# carries gcc, libc headers and the Python headers: triton compiles a C shim at run time, and
# without gcc the warm-up fails and startup fails closed.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04
# The bases: the CUDA images by default. stacks/semif-k8s/build-local-image.sh overrides all three
# with images made on a machine that cannot pull them (a debootstrapped Debian, a local uv).
ARG BUILDER_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}
ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------- builder
# hadolint ignore=DL3006
FROM ${BUILDER_IMAGE} AS builder

# g++ for the causal-conv1d host code (nvcc's host compiler); the devel image ships nvcc only.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

COPY --from=uv /uv /usr/local/bin/uv

ARG PYTHON_VERSION=3.12
# only-managed: uv's own CPython under /opt/python (copied to the runtime). only-system: the
# base's python3 (a base without internet access to uv's Python builds; the runtime base has it too).
ARG UV_PYTHON_PREFERENCE=only-managed
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=${UV_PYTHON_PREFERENCE} \
    UV_PYTHON=${PYTHON_VERSION} \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_FROZEN=1 \
    PATH=/app/.venv/bin:${PATH}

WORKDIR /app
RUN mkdir -p /opt/python \
 && if [ "${UV_PYTHON_PREFERENCE}" != only-system ]; then uv python install "${PYTHON_VERSION}"; fi

ARG EXTRAS="--extra kernels --extra otel"
ARG CAUSAL_CONV1D_FORCE_BUILD=FALSE
ARG MAX_JOBS=4

# 1. Dependencies, except causal-conv1d (its build needs torch etc. already in the venv).
COPY pyproject.toml uv.lock ./
# hadolint ignore=SC2086
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project ${EXTRAS} \
        --no-install-package causal-conv1d

# 2. causal-conv1d against the venv's torch (a no-op without the kernels extra). A layer of
#    its own, so a failed compile does not throw away the dependency layer above.
# hadolint ignore=DL3059,SC2086
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project ${EXTRAS} \
        --no-build-isolation-package causal-conv1d

# 3. The project itself, non-editable, so the runtime stage needs no source tree. The import
#    check catches a causal-conv1d built against another torch ABI here, not at warm-up.
COPY README.md ./
COPY src ./src
# hadolint ignore=SC2086
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable ${EXTRAS} \
        --no-build-isolation-package causal-conv1d \
 && python -c "import semif_serve.service.settings" \
 && case "${EXTRAS}" in *kernels*) python -c "import causal_conv1d" ;; *) ;; esac

# ---------------------------------------------------------------- runtime
# hadolint ignore=DL3006
FROM ${RUNTIME_IMAGE}

# gcc + libc6-dev: triton's run-time C shim (see above). Nothing else.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 semif \
 && useradd --system --uid 10001 --gid semif --create-home --home-dir /home/semif \
        --shell /usr/sbin/nologin semif

COPY --from=builder /opt/python /opt/python
COPY --from=builder /app/.venv /app/.venv

ENV PATH=/app/.venv/bin:${PATH} \
    HOME=/home/semif \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    NUMBA_CACHE_DIR=/home/semif/.cache/numba \
    SEMIF_HOST=0.0.0.0 \
    SEMIF_PORT=8032

WORKDIR /home/semif
USER 10001:10001
EXPOSE 8032

# Weights (7.8 GiB) load and the warm-up compiles triton kernels before /health says ready.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import json,os,sys,urllib.request as r; sys.exit(0 if json.load(r.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SEMIF_PORT', '8032'), timeout=5)).get('ready') is True else 1)"]

ENTRYPOINT ["semif-serve"]
