# dedup-relay image: multi-stage, non-root, configured by RELAY_* env vars.
# Build: docker build -t dedup-relay .
# Run:   docker run -e RELAY_UPSTREAM=smtp.example.com:587 -e RELAY_UPSTREAM_TLS=starttls \
#          -e RELAY_STORE=redis://redis:6379/0 -p 2525:2525 -p 9725:9725 \
#          -e RELAY_ALLOWED_NETWORKS=10.0.0.0/8,172.16.0.0/12,192.168.0.0/16 \
#          --stop-timeout 60 dedup-relay
# (clients reach a container through Docker's bridge, never from its loopback: without
# RELAY_ALLOWED_NETWORKS every client is told 421 4.7.0; name only the networks of your apps.
# --stop-timeout: more than shutdown_grace + 4 x store_timeout + 10 s, 48 s, the relay's own bound
# on a graceful stop, so in-flight mail finishes and owed settles reach the journal.)

# OCI labels: docker build --build-arg REVISION=$(git rev-parse HEAD) \
#   --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ) --build-arg SOURCE=<the repository's URL> \
#   -t dedup-relay .   (VERSION defaults to pyproject.toml's version; a test keeps them equal)

FROM python:3.11.10-slim-bookworm AS build
WORKDIR /src
# the dependencies first, from the lock (every distribution pinned by hash): a layer that a
# change under relay/ leaves cached; only requirements.lock changing rebuilds it
COPY requirements.lock ./
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes \
      -r requirements.lock
# then the project alone, built by the locked setuptools (no download, no dependency resolved)
COPY pyproject.toml README.md ./
COPY relay ./relay
# the operator files the package carries (relay/operator_files/ links to them)
COPY config ./config
COPY grafana/dashboards ./grafana/dashboards
COPY contrib/systemd ./contrib/systemd
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps \
      --no-build-isolation . \
 && /opt/venv/bin/pip check

FROM python:3.11.10-slim-bookworm
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/dedup-relay --create-home relay
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RELAY_LISTEN=0.0.0.0:2525 \
    RELAY_METRICS_LISTEN=0.0.0.0:9725 \
    RELAY_STORE=sqlite:////var/lib/dedup-relay/dedup-relay.db \
    RELAY_SETTLE_JOURNAL=/var/lib/dedup-relay/owed-settles.jsonl \
    RELAY_LOG_FORMAT=json
USER relay
WORKDIR /var/lib/dedup-relay
VOLUME ["/var/lib/dedup-relay"]
EXPOSE 2525 9725
# /healthz on the metrics port; with RELAY_METRICS_LISTEN=off, the SMTP greeting instead
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["dedup-relay", "healthcheck", "--timeout", "3"]
ENTRYPOINT ["dedup-relay"]
CMD ["serve"]
# last: CREATED and REVISION change on every build, and no layer above depends on them
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="dedup-relay" \
      org.opencontainers.image.description="SMTP relay proxy that stops duplicate outbound email (per-recipient fingerprints reserved in Redis, SQLite or PostgreSQL)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"
