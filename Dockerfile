# One image for every splitfeed process: the operator (`splitfeed operator`)
# and the loader sidecar it injects into GPU pods (`splitfeed sidecar`).
#
#   docker build -t splitfeed:0.1.0 .
#
# The build context is only what `pip install .` needs (see .dockerignore).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: it is the largest and changes least. The
# sidecar needs it only because lancedb.streaming imports it, so the CPU build
# is enough; pinned because anything newer resolves to a multi-GB CUDA wheel.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==2.13.0"

WORKDIR /tmp/splitfeed-src
COPY pyproject.toml ./
COPY trainer_client/ trainer_client/
COPY sidecar/ sidecar/
COPY operator/ operator/
COPY local/ local/
# The sidecar's and the operator's extras: `pip install .` alone is the trainer client.
# The extras' torch range is met by the CPU build above, so nothing larger is fetched.
RUN pip install ".[sidecar,operator]" \
    && splitfeed --version \
    && splitfeed sidecar --help >/dev/null && splitfeed operator --help >/dev/null \
    && rm -rf /tmp/splitfeed-src \
    && groupadd --gid 65532 splitfeed \
    && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/splitfeed \
       --shell /usr/sbin/nologin splitfeed

# Numeric, so that the kubelet can check runAsNonRoot (the chart sets 65532 too).
USER 65532:65532
WORKDIR /home/splitfeed
ENTRYPOINT ["splitfeed"]
CMD ["--help"]
