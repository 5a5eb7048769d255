"""Render grafana/dashboards/dedup-relay.json with real data, without Grafana.

Runs a relay (in this process) in front of an aiosmtpd sink that sometimes answers 451, hangs
after the final dot or goes away for a while, drives a bounded mixed load at it over loopback,
lets a real Prometheus (`prometheus` on PATH, Debian package) scrape it every second with the
shipped alert rules loaded, then evaluates every panel's PromQL through Prometheus' HTTP API and
draws the panels with matplotlib at their dashboard positions (the dashboard's ``$job`` and
``$instance`` variables as Grafana fills them for this one relay).

    .venv/bin/pip install -e '.[tools]'    # matplotlib, not in the dev extras
    .venv/bin/python tools/render_dashboard.py --out docs/dashboard.png --seconds 150

Needs Redis on 127.0.0.1:6379 (keys under a random prefix, deleted afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiosmtplib
import matplotlib
import redis
from aiosmtpd.smtp import SMTP

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend
from matplotlib.axes import Axes

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:
    # Run as a file (python tools/render_dashboard.py from the repo root): run it as the module
    # tools.render_dashboard instead, so the tests package (tests/support/) imports as a package.
    import os

    os.execv(sys.executable,  # noqa: S606  # this same interpreter, a fixed argument list
             [sys.executable, "-m", "tools.render_dashboard", *sys.argv[1:]])

from relay.app import Relay  # noqa: E402
from relay.settings import Settings  # noqa: E402
from tests.support.clients import message  # noqa: E402
from tests.support.net import free_port  # noqa: E402
from tests.support.sink import SinkHandler  # noqa: E402

RATE = "15s"  # $__rate_interval for a 1 s scrape interval
# what Grafana puts for the dashboard's variables here: the one job this script's Prometheus
# scrapes, every instance of it
VARIABLES = {"$__rate_interval": RATE, "$job": "dedup-relay", "$instance": ".+"}


class FlakySink(SinkHandler):
    """The test sink, answering 451 to 8 % of messages and hanging after 1 % of dots."""

    async def handle_DATA(self, server, session, envelope):  # type: ignore[no-untyped-def]
        roll = random.random()
        if roll < 0.08:
            return "451 4.3.0 upstream busy"
        if roll < 0.09:
            await asyncio.sleep(2.5)  # longer than the relay's upstream timeout
        return await super().handle_DATA(server, session, envelope)


async def client(port: int, stop_at: float, keys: list[tuple[str, str]]) -> None:
    """One application: new messages, retries of old ones, some without a key."""
    while time.monotonic() < stop_at:
        roll = random.random()
        rcpts = [f"user{random.randint(1, 40)}@example.net"]
        key: str | None = None
        if roll < 0.55:
            key = f"order-{uuid.uuid4().hex[:8]}"
            keys.append((key, rcpts[0]))
        elif roll < 0.9 and keys:
            key, rcpt = random.choice(keys)  # a retry: a duplicate unless the first try failed
            rcpts = [rcpt]
        try:
            body = "\r\n".join(["y" * 76] * random.randint(1, 500))
            await aiosmtplib.send(message(key=key, body=body), sender="app@example.com",
                                  recipients=rcpts, hostname="127.0.0.1", port=port,
                                  timeout=10, local_hostname="load.test")
        except aiosmtplib.SMTPException:
            pass  # 4yz/5yz answers are part of the picture
        await asyncio.sleep(random.uniform(0.02, 0.2))


async def drive(seconds: float, prom_port: int, workdir: Path, out: Path) -> None:
    """Run relay + sink + load + prometheus, then render the panels over the load's window."""
    handler = FlakySink()
    loop = asyncio.get_running_loop()
    sink_port = free_port()
    sink = await loop.create_server(lambda: SMTP(handler, decode_data=False), "127.0.0.1",
                                    sink_port)
    prefix = f"render:{uuid.uuid4().hex}:"
    relay = Relay(Settings.model_validate({
        "listen": "127.0.0.1:0", "upstream": f"127.0.0.1:{sink_port}",
        "store": "redis://127.0.0.1:6379/0", "store_prefix": prefix,
        "metrics_listen": "127.0.0.1:0", "upstream_timeout": 1.0, "lease": 30,
        "health_interval": 1.0, "hostname": "relay.render"}))
    await relay.start()
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(REPO / "config/prometheus/alerts.yml")],
        "scrape_configs": [{"job_name": "dedup-relay", "static_configs": [
            {"targets": [f"127.0.0.1:{relay.metrics_port}"]}]}]}))
    prom = subprocess.Popen(  # our own fixed command line
        [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
         f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.sleep(3)
        start = time.time()
        stop_at = time.monotonic() + seconds
        keys: list[tuple[str, str]] = []
        outage = asyncio.create_task(upstream_outage(sink, handler, sink_port, seconds))
        await asyncio.gather(*(client(relay.port, stop_at, keys) for _ in range(6)))
        await outage
        end = time.time()
        await asyncio.sleep(3)
        render(prom_port, start, end, out)
    finally:
        await cleanup(prom, relay, sink, prefix)


async def upstream_outage(sink: asyncio.base_events.Server, handler: SinkHandler, port: int,
                          seconds: float) -> None:
    """Take the upstream away for 12 s in the middle of the run."""
    await asyncio.sleep(seconds * 0.55)
    sink.close()
    await asyncio.sleep(12)
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: SMTP(handler, decode_data=False), "127.0.0.1", port)


async def cleanup(prom: subprocess.Popen[bytes], relay: Relay, sink: asyncio.base_events.Server,
                  prefix: str) -> None:
    """Stop everything and delete the run's keys."""
    prom.terminate()
    prom.wait(timeout=20)
    await relay.stop()
    sink.close()
    client = redis.Redis()
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)


def query_range(prom_port: int, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    """Evaluate ``expr`` over [start, end] with a 2 s step."""
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    params = urllib.parse.urlencode({"query": expr,
                                     "start": start, "end": end, "step": 2})
    url = f"http://127.0.0.1:{prom_port}/api/v1/query_range?{params}"
    with urllib.request.urlopen(url, timeout=30) as response:  # loopback only
        data = json.load(response)
    return list(data["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    """Apply a Grafana legend template such as ``{{outcome}}``."""
    for name, val in labels.items():
        template = template.replace("{{" + name + "}}", val)
    return template


def render(prom_port: int, start: float, end: float, out: Path) -> None:
    """Draw every panel at its gridPos (24 columns) into ``out``."""
    dashboard = json.loads((REPO / "grafana/dashboards/dedup-relay.json").read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(20, rows * 0.4))
    fig.suptitle("dedup-relay (grafana/dashboards/dedup-relay.json rendered from a real "
                 "Prometheus scrape; matplotlib, not Grafana)", fontsize=12)
    grid = fig.add_gridspec(rows, 24, hspace=2.5, wspace=1.5)
    for panel in panels:
        g = panel["gridPos"]
        ax = fig.add_subplot(grid[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        ax.set_title(panel["title"], fontsize=9)
        draw_panel(ax, panel, prom_port, start, end)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, bbox_inches="tight")


def draw_panel(ax: Axes, panel: dict[str, Any], prom_port: int, start: float,
               end: float) -> None:
    """One panel: a time series plot, or the last value for stat panels."""
    texts = []
    for target in panel["targets"]:
        for series in query_range(prom_port, target["expr"], start, end):
            points = [(float(t) - start, float(v)) for t, v in series["values"]]
            name = legend(target["legendFormat"], series["metric"])
            if panel["type"] == "stat":
                texts.append(f"{name}: {stat_text(panel, points[-1][1])}" if points else "-")
            else:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
    if panel["type"] == "stat":
        ax.axis("off")
        ax.text(0.5, 0.5, "\n".join(texts) or "no data", ha="center", va="center", fontsize=10)
        return
    ax.set_xlabel("seconds into the run", fontsize=7)
    ax.tick_params(labelsize=7)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")


def stat_text(panel: dict[str, Any], val: float) -> str:
    """A stat value through the panel's value mappings (1 -> UP)."""
    defaults = panel["fieldConfig"]["defaults"]
    for mapping in defaults.get("mappings", []):
        if f"{val:g}" in mapping["options"]:
            return str(mapping["options"][f"{val:g}"]["text"])
    return f"{val:g}"


def main() -> None:
    """Parse the arguments, run the load, render the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=150.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(drive(args.seconds, free_port(), Path(tmp), args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
