"""Metrics, health endpoints, decision logs and the shipped dashboard/alert rules, observed on a
running relay over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from relay.app import Relay
from relay.core.fingerprint import fingerprint, store_key
from relay.core.recipients import normalize_recipient
from relay.ops.logs import TextFormatter, json_lines
from relay.settings import RateLimit
from tests.support.clients import message, send
from tests.support.relays import MakeRelay, PrivateRedis
from tests.support.sink import Sink, start_sink

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "grafana" / "dashboards" / "dedup-relay.json"
ALERTS = REPO / "config" / "prometheus" / "alerts.yml"
# names Prometheus itself makes, not the relay
PROMETHEUS_OWN = {"up"}


async def get(url: str) -> tuple[int, str]:
    """GET ``url``; return (status, body)."""
    async with aiohttp.ClientSession() as session, session.get(
            url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        return response.status, await response.text()


async def scrape(relay: Relay) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape /metrics: {(sample name, sorted labels): value}."""
    status, body = await get(f"http://127.0.0.1:{relay.metrics_port}/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    """One sample's value (0.0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    """Poll the async ``predicate`` until it returns True."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


@pytest.fixture
async def observed(make_relay: MakeRelay, sink: Sink) -> Relay:
    """A relay with metrics and health on a free port, probing every 0.3 s."""
    return await make_relay(upstream=f"127.0.0.1:{sink.port}", metrics_listen="127.0.0.1:0",
                            health_interval=0.3, rate_limit=(RateLimit.model_validate(
                                {"scope": "upstream", "messages": 100000, "per": 1}),))


async def test_counters_follow_a_short_load(observed: Relay, sink: Sink) -> None:
    """Relayed, suppressed, no-key and temp-failed sends move exactly their counters."""
    for i in range(5):
        await send(observed.port, ["user@example.net"], message(key=f"L-{i}"))
    for i in range(3):
        await send(observed.port, ["user@example.net"], message(key=f"L-{i}"))
    for _ in range(2):
        await send(observed.port, ["user@example.net"], message(key=None))
    sink.handler.data_plan.append("451 4.3.0 try later")
    await send(observed.port, ["user@example.net"], message(key="L-temp"))
    samples = await scrape(observed)
    assert value(samples, "relay_messages_total", result="relayed") == 5
    assert value(samples, "relay_messages_total", result="suppressed") == 3
    assert value(samples, "relay_messages_total", result="no_key") == 2
    assert value(samples, "relay_messages_total", result="tempfail") == 1
    assert value(samples, "relay_recipients_total", outcome="relayed") == 5
    assert value(samples, "relay_recipients_total", outcome="suppressed") == 3
    assert value(samples, "relay_recipients_total", outcome="refused_temp") == 1
    named = f"127.0.0.1:{sink.port}"  # the upstream's name: its address
    assert value(samples, "relay_upstream_replies_total", code_class="2xx", upstream=named) == 7
    assert value(samples, "relay_upstream_replies_total", code_class="4xx", upstream=named) == 1
    assert value(samples, "relay_upstream_seconds_count") == 8
    assert value(samples, "relay_store_seconds_count", op="reserve") == 9
    assert value(samples, "relay_store_errors_total", op="reserve") == 0
    assert value(samples, "relay_message_bytes_count") == 11
    assert value(samples, "relay_sessions_active") == 0
    assert value(samples, "relay_messages_in_progress") == 0
    build = [k for k in samples if k[0] == "relay_build_info"]
    assert build and dict(build[0][1])["version"]


async def test_no_label_holds_an_address_or_key(observed: Relay) -> None:
    """No metric label value holds a recipient, a dedupe key or a fingerprint."""
    await send(observed.port, ["secret.person@example.net"], message(key="KEY-SECRET"))
    _, body = await get(f"http://127.0.0.1:{observed.metrics_port}/metrics")
    assert "secret.person" not in body and "KEY-SECRET" not in body
    assert not re.search(r"[0-9a-f]{64}", body)


async def test_healthz_answers_while_serving(observed: Relay) -> None:
    """/healthz answers 200 with status ok."""
    status, body = await get(f"http://127.0.0.1:{observed.metrics_port}/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}


async def test_readyz_flips_with_redis_and_recovers(
    make_relay: MakeRelay, sink: Sink, private_redis: PrivateRedis
) -> None:
    """/readyz goes 503 naming the store within seconds of Redis stopping, 200 after restart."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=private_redis.url,
                             metrics_listen="127.0.0.1:0", health_interval=0.3,
                             store_timeout=0.5)
    url = f"http://127.0.0.1:{relay.metrics_port}/readyz"
    status, body = await get(url)
    assert status == 200 and json.loads(body)["ready"] is True
    private_redis.stop()

    async def store_down() -> bool:
        status, body = await get(url)
        parts = json.loads(body)["components"]
        return status == 503 and not parts["store"]["ok"] and parts["upstream"]["ok"]

    await wait_for(store_down)
    samples = await scrape(relay)
    assert value(samples, "relay_component_up", component="store") == 0
    assert value(samples, "relay_component_up", component="upstream") == 1
    private_redis.start()

    async def ready() -> bool:
        return (await get(url))[0] == 200

    await wait_for(ready)


async def test_readyz_names_the_upstream_when_it_goes_away(make_relay: MakeRelay) -> None:
    """/readyz says upstream (not store) failed when the smarthost stops, and recovers."""
    upstream = await start_sink()
    port = upstream.port
    relay = await make_relay(upstream=f"127.0.0.1:{port}", metrics_listen="127.0.0.1:0",
                             health_interval=0.3)
    url = f"http://127.0.0.1:{relay.metrics_port}/readyz"
    assert (await get(url))[0] == 200
    upstream.server.close()
    await upstream.server.wait_closed()

    async def upstream_down() -> bool:
        status, body = await get(url)
        parts = json.loads(body)["components"]
        return status == 503 and not parts["upstream"]["ok"] and parts["store"]["ok"]

    await wait_for(upstream_down)
    from aiosmtpd.smtp import SMTP

    loop = asyncio.get_running_loop()
    again = await loop.create_server(lambda: SMTP(upstream.handler), "127.0.0.1", port)

    async def ready() -> bool:
        return (await get(url))[0] == 200

    try:
        await wait_for(ready)
    finally:
        again.close()


async def test_one_json_decision_line_per_message(
    observed: Relay, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    """Each message logs one structured decision: outcomes, upstream queue id, latency."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    sink.handler.data_plan.append("250 2.0.0 Ok: queued as ABC123")
    sent = message(key="LOG-1", extra="Message-ID: <log-1@app.example>\r\n")
    await send(observed.port, ["john.doe@example.net"], sent, mail_from="billing@shop.example")
    await send(observed.port, ["john.doe@example.net"], sent, mail_from="billing@shop.example")
    records = [r for r in caplog.records if r.name == "relay.smtp.handler" and r.msg == "message"]
    assert len(records) == 2
    line = json.loads(json_lines().format(records[0]))
    assert line["result"] == "relayed"
    assert line["outcomes"] == {"j***@example.net": "relayed"}
    # the store key, so an operator can inspect / release the record of this message
    [key] = line["keys"].values()
    assert key == store_key(observed.settings.store_prefix, fingerprint(
        normalize_recipient("john.doe@example.net"), "welcome", "LOG-1"))
    assert line["upstream_queue_id"] == "ABC123"
    # who sent it and which message it was, for incident work; no AUTH user: none logged in
    assert line["client"] == "127.0.0.1"
    assert line["from"] == "b***@shop.example"
    assert line["message_id"] == "<log-1@app.example>"
    assert "auth_user" not in line
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]), line["time"]
    assert line["latency_ms"] >= 0 and line["bytes"] > 0
    assert "john.doe" not in json.dumps(line)
    assert json.loads(json_lines().format(records[1]))["result"] == "suppressed"
    text = TextFormatter("%(message)s").format(records[1])
    assert "result='suppressed'" in text


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (identifiers followed by { [ or ), not functions)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # drop label values
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)", expr))
    names |= set(re.findall(r"\b(relay_[a-z0-9_]+)\b", expr))
    return names


def exported(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """Every sample name the relay exports."""
    return {name for name, _ in samples}


async def test_dashboard_and_rules_use_only_exported_metrics(observed: Relay) -> None:
    """Every metric the dashboard (panels and job/instance variables) and the alert rules
    query is one a live relay exports."""
    await send(observed.port, ["user@example.net"], message(key="DASH-1"))
    names = exported(await scrape(observed)) | PROMETHEUS_OWN
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load(ALERTS.read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) >= 20
    used = set().union(*(metric_names_in(e) for e in exprs))
    assert {"relay_messages_total", "relay_upstream_seconds_bucket", "relay_build_info"} <= used
    missing = sorted(used - names)
    assert not missing, f"dashboard/rules use metrics the relay does not export: {missing}"


def test_dashboard_panels_cover_what_operators_watch() -> None:
    """The dashboard has throughput, suppression, outcomes, latency, store and readiness panels."""
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"])
    for word in ("Throughput", "suppressed per minute", "Suppression ratio", "outcome",
                 "Upstream latency", "Store latency", "Store errors", "UNKNOWN", "ready"):
        assert word in titles


def test_alert_rules_pass_promtool() -> None:
    """promtool accepts the alert rules (.ci/run installs it)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (.ci/run installs the prometheus package)")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


async def test_content_refused_by_the_listener_is_counted_invalid(observed: Relay) -> None:
    """A message refused at the final dot for a too-long line counts as result=invalid."""
    result = await send(observed.port, ["user@example.net"], message(body="z" * 2000))
    assert result.code == 500
    samples = await scrape(observed)
    assert value(samples, "relay_messages_total", result="invalid") == 1
    assert value(samples, "relay_messages_total", result="relayed") == 0


async def test_maildir_readiness_fails_for_a_plain_file(tmp_path: Path) -> None:
    """--upstream maildir:FILE: readiness says upstream down (deliveries would all fail)."""
    from relay.upstream.maildir import MaildirUpstream

    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(ConnectionError, match=r"not a Maildir|Not a directory"):
        await MaildirUpstream(path=tmp_path / "afile").ping()
    await MaildirUpstream(path=tmp_path / "box").ping()  # a missing one is created: ready
    assert (tmp_path / "box" / "new").is_dir()
