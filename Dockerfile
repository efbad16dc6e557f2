# syntax=docker/dockerfile:1
# memfuse: the sidecar (`memfuse mount`, runs as root: FUSE mount(2)) and the control plane
# (`memfuse serve`, `memfuse db upgrade`: the default user, memfuse, uid 10001).
#   scripts/build-image [TAG]          builds with docker or buildah
# Dependencies come from requirements.lock (pip-compile output with hashes, PostgreSQL driver
# included); regenerate it with the command at its top after changing pyproject.toml.
# The base is pinned to a Debian point release; pin it by digest too for reproducible builds:
#   scripts/build-image --build-arg BASE=debian:12.8-slim@sha256:<digest>
ARG BASE=debian:12.8-slim

# ---------------------------------------------------------------- build: compile, install
FROM ${BASE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev libfuse3-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements.lock ./
RUN python3 -m venv /opt/memfuse \
    && /opt/memfuse/bin/pip install --no-cache-dir --disable-pip-version-check \
        --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md LICENSE ./
COPY memfuse ./memfuse
# memfuse itself (its dependencies are all in the lock already), then no installer is left
# for the runtime image: pip and setuptools leave the virtualenv
RUN /opt/memfuse/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps . \
    && /opt/memfuse/bin/pip uninstall -y pip setuptools wheel \
    && /opt/memfuse/bin/python -c "import memfuse.cli, pyfuse3, psycopg" \
    && ! ls /opt/memfuse/lib/python3*/site-packages | grep -E '^(pip|setuptools)([-_.]|$)'

# ---------------------------------------------------------------- runtime
FROM ${BASE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
# Where the source of this image is published (a repository URL); empty unless given, e.g.
# SOURCE_URL=https://... scripts/build-image
ARG SOURCE_URL=
LABEL org.opencontainers.image.title="memfuse" \
      org.opencontainers.image.description="Long-term memory for AI agents, served as plain files over FUSE: sidecar and control plane" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.base.name="${BASE}"
# python3 from Debian (no pip, no setuptools); fuse3 for fusermount3 (auto_unmount) and
# libfuse3 for pyfuse3
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 fuse3 libfuse3-3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 memfuse \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin memfuse \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/memfuse \
    && install -d -m 0700 /var/cache/memfuse
COPY --from=build /opt/memfuse /opt/memfuse
ENV PATH=/opt/memfuse/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    MEMFUSE_HOME=/var/lib/memfuse \
    MEMFUSE_CACHE_DIR=/var/cache/memfuse
# The control plane's port and the sidecar's admin API (/healthz, /readyz, /metrics; mount
# changes only on the Unix socket /var/cache/memfuse/admin.sock, or with an admin token)
EXPOSE 8080 9464
# Non-root by default: `memfuse serve` and `memfuse db upgrade`. The sidecar runs as root
# (mount(2) of FUSE): docker run --user 0 --privileged ... memfuse mount ...; in Kubernetes
# its container sets runAsUser: 0 (deploy/kubernetes/base/agent.yaml).
USER 10001:10001
# For plain Docker (Kubernetes uses its own probes): the control plane's /healthz, or the
# sidecar's with MEMFUSE_HEALTHCHECK_URL=http://127.0.0.1:9464/healthz
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["/opt/memfuse/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('MEMFUSE_HEALTHCHECK_URL', 'http://127.0.0.1:8080/healthz'), timeout=8)"]
ENTRYPOINT ["memfuse"]
CMD ["serve", "--listen", "0.0.0.0:8080"]
