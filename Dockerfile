# shardlb: the router (`shardlb serve`, the entry point), the archiver and the maintenance commands
# (`shardlb archive`, `rebuild`, `reconcile`: k8s/base/archiver sets the command) and, with the bench
# extra, Locust for the in-cluster load test (k8s/components/locust runs `locust` from this image).
# PostgreSQL's client library comes with the psycopg[binary] wheel: nothing to install for it.
#
#   docker build -t shardlb:0.1.0 .
#   docker run --rm -p 8000:8000 -e SHARDLB_REDIS_URL=redis://host:6379 shardlb:0.1.0
#   docker run --rm --no-healthcheck --entrypoint shardlb -e SHARDLB_REDIS_URL=redis://host:6379 \
#     -e SHARDLB_POSTGRES_URL=postgresql://user:pw@host/db shardlb:0.1.0 archive --metrics-port 9102
#
# (the HEALTHCHECK asks the router's /healthz, hence --no-healthcheck for the archiver; Kubernetes
# ignores HEALTHCHECK and probes /metrics instead)
#
# Two stages: the builder installs the checkout with its bench extra into a virtualenv; the final
# image gets only that virtualenv on the same slim Python, so pip's build dependencies and caches
# never reach it. Every dependency ships manylinux wheels for CPython 3.11 on amd64 and arm64, so
# no compiler is needed (if one ever is, install it in the builder stage only).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# only what the package build reads (.dockerignore keeps everything else out of the context)
COPY pyproject.toml README.md ./
COPY shardlb ./shardlb
COPY router ./router
COPY bench ./bench
# DL3013 (pin pip versions) does not fit: this installs the checkout itself, whose dependency
# bounds live in pyproject.toml
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[bench]"
# The Locust pods (k8s/components/locust) run the locustfile installed above, at a fixed path; the
# build fails here if the package ever stops shipping it.
RUN ln -s "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/bench/locustfile.py" \
        /opt/venv/locustfile.py \
    && test -f /opt/venv/locustfile.py

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shardlb" \
      org.opencontainers.image.description="Sharded leaderboard router and archiver on Redis Cluster" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 shardlb \
    && useradd --system --uid 10001 --gid shardlb --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin shardlb
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SHARDLB_HOST=0.0.0.0 \
    SHARDLB_PORT=8000
USER 10001:10001
EXPOSE 8000
# process up = /healthz answers 200 (urllib raises on any other status, or when nothing listens)
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SHARDLB_PORT', '8000') + '/healthz', timeout=2).close()"]
ENTRYPOINT ["shardlb", "serve"]
