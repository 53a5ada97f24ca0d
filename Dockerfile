# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t diloco-operator:0.1.0 .     (kopf operator; no torch)
#   docker build --target trainer  -t diloco-trainer:0.1.0 .      (syncer + learner; CPU torch)
#   docker build --target trainer --build-arg TORCH_VARIANT=cu128 -t diloco-trainer:0.1.0-cuda .
# Both pin their Python dependencies with requirements.lock (as constraints) and run as UID 10001.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 diloco && useradd --uid 10001 --gid 10001 --create-home diloco
WORKDIR /opt/diloco
COPY requirements.lock pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
COPY chaos/ chaos/

FROM base AS operator
RUN pip install -c requirements.lock ".[operator]" \
 && python -c "import sys, diloco_operator.handlers; assert 'torch' not in sys.modules"
COPY crds/ crds/
USER 10001:10001
EXPOSE 8080 8081
CMD ["diloco", "operator"]

FROM base AS trainer
# cpu (default), or a CUDA build of torch such as cu128; TPU images add torch_xla on top.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl
RUN TORCH_VERSION=$(sed -n 's/^torch==//p' requirements.lock) \
 && pip install --index-url "${TORCH_INDEX}/${TORCH_VARIANT}" "torch==${TORCH_VERSION}" \
 && pip install -c requirements.lock ".[trainer]" \
 && diloco --help >/dev/null
USER 10001:10001
EXPOSE 8470 8471
CMD ["diloco", "--help"]
