# dedup-relay image: multi-stage, non-root, configured by RELAY_* env vars.
# Build: docker build -t dedup-relay .
# Run:   docker run -e RELAY_UPSTREAM=smtp.example.com:587 -e RELAY_UPSTREAM_TLS=starttls \
#          -e RELAY_STORE=redis://redis:6379/0 -p 2525:2525 -p 9725:9725 \
#          -e RELAY_ALLOWED_NETWORKS=10.0.0.0/8,172.16.0.0/12,192.168.0.0/16 \
#          --stop-timeout 35 dedup-relay
# (clients reach a container through Docker's bridge, never from its loopback: without
# RELAY_ALLOWED_NETWORKS every client is told 421 4.7.0; name only the networks of your apps.
# --stop-timeout: a little more than shutdown_grace, 30 s, so in-flight mail can finish.)

FROM python:3.11.10-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY relay ./relay
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check .

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
