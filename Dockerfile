# rnnserve for GPU hosts (it also runs without a GPU: RNNSERVE_DEVICE=auto falls back to CPU).
#   docker build -t rnnserve .
#   docker run --rm --gpus all -p 8000:8000 rnnserve
# torch with CUDA 12.8 / cuDNN 9 (and Python 3.11) comes from the base image; installing rnnserve
# keeps that torch: the project only asks for torch>=2.4, and the install is pinned to it.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

# Only what the wheel needs: the project metadata and the two packages. The bundled weights,
# models/weights/*.safetensors, are package data and are installed with `models`.
COPY pyproject.toml README.md /tmp/rnnserve-src/
COPY models/ /tmp/rnnserve-src/models/
COPY service/ /tmp/rnnserve-src/service/

# Constrain torch to the base image's exact build so that resolving the project's dependencies
# can never replace it; then check the installed package really carries its models.
RUN python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
        > /tmp/torch-constraint.txt \
    && python -m pip install --no-cache-dir --constraint /tmp/torch-constraint.txt /tmp/rnnserve-src \
    && rm -rf /tmp/rnnserve-src /tmp/torch-constraint.txt \
    && python -c "import models; assert models.available() == ['smoother', 'traveller'], models.available()" \
    && rnnserve --help > /dev/null

# A numeric UID:GID, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN groupadd --gid 10001 rnnserve \
    && useradd --create-home --no-log-init --uid 10001 --gid 10001 --shell /usr/sbin/nologin rnnserve
USER 10001:10001
WORKDIR /home/rnnserve

# The service binds 127.0.0.1 by default; in a container it must listen on all interfaces.
ENV RNNSERVE_HOST=0.0.0.0 \
    RNNSERVE_PORT=8000

EXPOSE 8000

# Ready (200) once the models are loaded and warmed up; 503 while starting or draining.
# No curl in the base image, so the probe is Python's urllib.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('RNNSERVE_PORT', '8000') + '/readyz', timeout=4); sys.exit(0 if r.status == 200 else 1)"]

CMD ["rnnserve"]
