# rnnserve for GPU hosts; it also runs without a GPU (RNNSERVE_DEVICE=auto falls back to the CPU).
#   docker build -t rnnserve .
#   docker run --rm --gpus all -p 8000:8000 rnnserve
# Two stages on one base, Python 3.11 on Debian 13 (trixie): `build` makes the wheel (rnnserve, its
# models and bundled weights) from the sources; the final stage installs only that wheel and one
# pinned torch release, whose PyPI wheel brings its CUDA libraries as packages of their own, so no
# source tree, build tool or pip cache reaches the image that runs. docs/DEPLOY.md, "The image's
# base", says why this base and how to raise the torch pin.

# ---- build: the wheel (pure Python: the same wheel serves any Python 3.11+) ----------------------
FROM python:3.11-slim-trixie AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

# Only what the wheel needs: the project metadata and the folders that install as rnnserve,
# rnnserve.models and rnnserve.service. The bundled weights, models/weights/*.safetensors, are
# package data and go into the wheel with rnnserve.models.
COPY pyproject.toml README.md /src/
COPY models/ /src/models/
COPY service/ /src/service/
COPY rnnserve/ /src/rnnserve/

RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

# ---- runtime: Python 3.11 on Debian 13, torch from PyPI with its CUDA libraries ------------------
FROM python:3.11-slim-trixie AS runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The torch release, and the CUDA version its Linux x86_64 wheel on PyPI is built for.
ARG TORCH_VERSION=2.14.1
ARG TORCH_CUDA=13.0

# NVIDIA_DRIVER_CAPABILITIES: without `compute` the NVIDIA Container Toolkit mounts no libcuda, and
# torch would find no GPU. NVIDIA_REQUIRE_CUDA: the toolkit refuses to start the container on a
# driver too old for that CUDA, instead of the server quietly serving from the CPU.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${TORCH_CUDA}"

# Triton builds each GPU kernel's launcher with the C compiler when the server warms up on a GPU.
# The Debian release is fixed by the base's tag; its packages are left unpinned so that each build
# takes that release's security updates (a pinned version leaves the archive once it is replaced).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /wheels/ /tmp/wheels/

# torch and the wheel in one resolution, so that the project's dependencies cannot pick another
# torch; then check that the installed torch is the pinned release and CUDA build, and that the
# installed package carries its models.
RUN python -m pip install --no-cache-dir "torch==${TORCH_VERSION}" /tmp/wheels/rnnserve-*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import os, torch; found = (torch.__version__.split('+')[0], str(torch.version.cuda)); assert found == (os.environ['TORCH_VERSION'], os.environ['TORCH_CUDA']), found" \
    && python -c "from rnnserve import models; assert models.available() == ['smoother', 'traveller'], models.available()" \
    && rnnserve --help > /dev/null

# A numeric UID:GID, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd. The numba
# cache folder belongs to that user: the build-time warm-up below fills it.
RUN groupadd --gid 10001 rnnserve \
    && useradd --create-home --no-log-init --uid 10001 --gid 10001 --shell /usr/sbin/nologin rnnserve \
    && install -d -o 10001 -g 10001 /var/cache/rnnserve/numba
COPY deploy/docker/warmup.py /opt/rnnserve/warmup.py

USER 10001:10001
WORKDIR /home/rnnserve

# numba writes its compiled kernels here (cache=True ones); Kubernetes mounts an emptyDir instead.
ENV NUMBA_CACHE_DIR=/var/cache/rnnserve/numba

# Compile at build time, not at first request: load and warm every bundled model on the CPU, as
# the server's start-up does. A broken install or a kernel that no longer compiles fails the build.
RUN python /opt/rnnserve/warmup.py

# The service binds 127.0.0.1 by default; in a container it must listen on all interfaces.
ENV RNNSERVE_HOST=0.0.0.0 \
    RNNSERVE_PORT=8000

EXPOSE 8000

# Ready (200) once the models are loaded and warmed up; 503 while starting or draining.
# No curl in the base image, so the probe is Python's urllib, on whatever RNNSERVE_PORT says.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('RNNSERVE_PORT', '8000') + '/readyz', timeout=4); sys.exit(0 if r.status == 200 else 1)"]

ENTRYPOINT ["rnnserve"]
CMD []
