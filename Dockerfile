# dedup-relay image: multi-stage, non-root, configured by RELAY_* env vars.
# Build: docker build -t dedup-relay .
# Run:   docker run -e RELAY_UPSTREAM=smtp.example.com:587 -e RELAY_UPSTREAM_TLS=starttls \
#          -e RELAY_STORE=redis://redis:6379/0 -p 2525:2525 -p 9725:9725 dedup-relay

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
    RELAY_LOG_FORMAT=json
USER relay
WORKDIR /var/lib/dedup-relay
VOLUME ["/var/lib/dedup-relay"]
EXPOSE 2525 9725
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9725/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["dedup-relay"]
CMD ["serve"]
