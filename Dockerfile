# Two images from one file:
#   docker build --target operator -t diloco-operator:0.1.0 .     (kopf operator; no torch)
#   docker build --target trainer  -t diloco-trainer:0.1.0 .      (syncer + learner; CPU torch)
#   docker build --target trainer --build-arg TORCH_VARIANT=cu128 -t diloco-trainer:0.1.0-cuda .
#   docker build --target trainer-xla -t diloco-trainer:0.1.0-xla .  (syncer + learner; torch + torch_xla for TPUs)
# Build arguments:
#   BASE_IMAGE     any image with Python 3.11 and pip on PATH and groupadd/useradd (default python:3.11-slim;
#                  hack/build-images.sh builds diloco.local/python:3.11 from Debian where Docker Hub is out of reach).
#                  Pin it by digest for a reproducible build: BASE_IMAGE=python:3.11-slim@sha256:<digest> (the digest
#                  from `docker buildx imagetools inspect python:3.11-slim`, or `docker image inspect --format
#                  '{{index .RepoDigests 0}}' python:3.11-slim` after a pull); the default tag follows security fixes.
#   TORCH_INDEX    wheel index for torch, default https://download.pytorch.org/whl (+ /TORCH_VARIANT).
#                  TORCH_INDEX=pypi installs torch from PyPI instead: its CUDA build, with the nvidia-* wheels
#                  pinned by requirements.lock (a ~6 GB image), for networks that reach PyPI but not that index.
#   TORCH_VARIANT  cpu (default) or a CUDA build such as cu128; unused with TORCH_INDEX=pypi
#   LIBTPU         trainer-xla: the TPU runtime, default libtpu==0.0.21 (what torch_xla 2.9.0's [tpu] extra pins);
#                  none leaves it out (then only torch_xla's CPU device, PJRT_DEVICE=CPU, and its CUDA plugin remain)
# Plain Dockerfile syntax: builds with BuildKit or the legacy builder (DOCKER_BUILDKIT=0).
# The dependencies (requirements.lock as constraints, the extras of pyproject.toml) are installed before the
# sources are copied, so a code change rebuilds only the last layers. Every file pip installs is checked against
# the lock's sha256s (--require-hashes; pip itself first, from the lock: older pips ignore a constraints file's
# hashes), except torch from the PyTorch index (TORCH_INDEX other than pypi; the lock has PyPI's files) and the
# trainer-xla target's requirements-xla.lock (docs/security.md). Both images run as UID 10001.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 diloco && useradd --uid 10001 --gid 10001 --create-home diloco
WORKDIR /opt/diloco
COPY requirements.lock ./
RUN awk '/^[^ #]/ { keep = /^pip==/ } keep' requirements.lock > /tmp/pip.lock \
 && pip install --require-hashes -r /tmp/pip.lock && rm /tmp/pip.lock

FROM base AS operator
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator']))" > /tmp/deps.txt \
 && pip install --require-hashes -c requirements.lock -r /tmp/deps.txt && rm /tmp/deps.txt
COPY README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
COPY chaos/ chaos/
COPY kube/ kube/
# --no-deps: every dependency is in place, checked; the project itself is a directory, which has no hash
RUN pip install --no-deps ".[operator]" \
 && python -c "import sys, diloco_operator.handlers; assert 'torch' not in sys.modules"
COPY crds/ crds/
USER 10001:10001
EXPOSE 8080 8081
CMD ["diloco", "operator"]

FROM base AS trainer
# cpu (default), or a CUDA build of torch such as cu128; TPU images add torch_xla on top.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl
# From the PyTorch index torch alone (--no-deps: its dependencies come from PyPI below, checked), by version only.
RUN TORCH_VERSION=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements.lock) \
 && if [ "${TORCH_INDEX}" = pypi ]; then \
      pip install --require-hashes -c requirements.lock "torch==${TORCH_VERSION}"; \
    else \
      pip install --no-deps --index-url "${TORCH_INDEX}/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['trainer']))" > /tmp/deps.txt \
 && pip install --require-hashes -c requirements.lock -r /tmp/deps.txt && rm /tmp/deps.txt
COPY README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
COPY chaos/ chaos/
COPY kube/ kube/
RUN pip install --no-deps ".[trainer]" \
 && diloco --help >/dev/null
USER 10001:10001
EXPOSE 8470 8471
CMD ["diloco", "--help"]

FROM base AS trainer-xla
# torch_xla pins its own torch (2.9.0), older than the trainer target's, so this image installs requirements-xla.lock
# (torch, torch_xla and what the learner and syncer import, at requirements.lock's versions) instead; its learners
# and syncer interoperate with the trainer image's (docs/xla.md). torch from PyPI brings its CUDA wheels (~7 GB).
ARG LIBTPU=libtpu==0.0.21
COPY requirements-xla.lock ./
RUN pip install -r requirements-xla.lock \
 && if [ "${LIBTPU}" != none ]; then pip install "${LIBTPU}"; fi
# torch_xla's _XLAC links against libpython3.11.so.1.0: python:3.11-slim has it, a base on Debian's python3 may not.
RUN ldconfig -p | grep -q 'libpython3\.11\.so\.1\.0' || { apt-get -o Acquire::Retries=3 update \
 && apt-get install -y --no-install-recommends libpython3.11 && apt-get clean && rm -rf /var/lib/apt/lists/*; }
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
COPY chaos/ chaos/
COPY kube/ kube/
# --no-deps: the trainer extra would pull requirements.lock's torch over torch_xla's
RUN pip install --no-deps . \
 && diloco --help >/dev/null \
 && PJRT_DEVICE=CPU python -c "import torch_xla, diloco_trainer.learner.loop, diloco_trainer.syncer.main"
USER 10001:10001
EXPOSE 8470 8471
CMD ["diloco", "--help"]
