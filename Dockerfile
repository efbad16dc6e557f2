# memfuse sidecar / control-plane image: a small Debian runtime with fuse3.
# Build: docker build -t memfuse .   Run: see deploy/kubernetes.yaml
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        gcc libc6-dev libfuse3-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY memfuse ./memfuse
RUN python -m venv /opt/memfuse && /opt/memfuse/bin/pip install --no-cache-dir .

FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 libfuse3-3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/memfuse /opt/memfuse
ENV PATH=/opt/memfuse/bin:$PATH \
    MEMFUSE_CACHE_DIR=/var/cache/memfuse \
    MEMFUSE_ADMIN_LISTEN=0.0.0.0:9464
VOLUME ["/var/cache/memfuse"]
EXPOSE 9464
# The sidecar: memfuse mount /mnt/memory --control-plane URL --workspace WS --token-file F
ENTRYPOINT ["memfuse"]
CMD ["mount", "/mnt/memory"]
