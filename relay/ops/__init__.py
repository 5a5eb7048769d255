"""Operations: Prometheus metrics, health, the HTTP endpoint and log formatting."""
