"""What can be checked of the Docker image and the compose stack without a Docker engine:
the commands the image runs exist, ports and env names match the settings, files it mounts
exist, the store is configured as design.md §3 asks."""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from relay.cli.group import main as cli_main
from relay.config import Settings, split_host_port

REPO = Path(__file__).resolve().parents[2]
FIELDS = set(Settings.model_fields)


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, argument) pairs of the Dockerfile, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, arg = line.partition(" ")
            out.append((word.upper(), arg.strip()))
    return out


def docker_env() -> dict[str, str]:
    """The ENV of the final stage."""
    env: dict[str, str] = {}
    for word, arg in dockerfile():
        if word == "FROM":
            env = {}
        elif word == "ENV":
            for item in shlex.split(arg):
                name, _, val = item.partition("=")
                env[name] = val
    return env


def compose() -> dict[str, Any]:
    """compose.yaml parsed."""
    loaded = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def relay_env_names(env: dict[str, str]) -> set[str]:
    """Settings field names of the RELAY_* variables in ``env``."""
    return {k[len("RELAY_"):].lower() for k in env if k.startswith("RELAY_")}


def test_base_images_are_pinned() -> None:
    """Every FROM names an exact version tag, never latest or a bare name."""
    for word, arg in dockerfile():
        if word == "FROM":
            image = arg.split()[0]
            assert re.search(r":\d+\.\d+\.\d+", image), image


def test_image_runs_as_non_root_with_a_healthcheck_on_healthz() -> None:
    """The final stage has a non-root USER and a HEALTHCHECK running `dedup-relay healthcheck`
    (a command of the project's CLI: /healthz, or the SMTP greeting with metrics off)."""
    steps = dockerfile()
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = [a for w, a in final if w == "HEALTHCHECK"]
    assert health
    command = yaml.safe_load(health[0].split("CMD", 1)[1])
    assert command[:2] == ["dedup-relay", "healthcheck"]
    assert "healthcheck" in cli_main.commands


def test_compose_gives_the_relay_time_to_drain() -> None:
    """stop_grace_period outlasts shutdown_grace, or Docker kills in-flight transactions."""
    relay = compose()["services"]["relay"]
    grace = float(relay["environment"].get("RELAY_SHUTDOWN_GRACE", Settings.model_fields[
        "shutdown_grace"].default))
    assert float(str(relay["stop_grace_period"]).removesuffix("s")) > grace


def test_image_command_is_the_projects_console_script() -> None:
    """ENTRYPOINT is the dedup-relay console script and CMD one of its subcommands."""
    steps = dict(dockerfile())
    entry = yaml.safe_load(steps["ENTRYPOINT"])
    cmd = yaml.safe_load(steps["CMD"])
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["dedup-relay"] and "dedup-relay" in scripts
    assert cmd[0] in cli_main.commands


def test_image_env_and_ports_match_the_settings() -> None:
    """Every RELAY_* in the image is a setting, it listens on 0.0.0.0, EXPOSE matches."""
    env = docker_env()
    assert relay_env_names(env) <= FIELDS
    listen_host, listen_port = split_host_port(env["RELAY_LISTEN"], what="listen")
    _, metrics_port = split_host_port(env["RELAY_METRICS_LISTEN"], what="metrics")
    assert listen_host == "0.0.0.0"  # noqa: S104  # inside a container, by design
    exposed = {int(p) for w, a in dockerfile() if w == "EXPOSE" for p in a.split()}
    assert exposed == {listen_port, metrics_port}
    Settings.model_validate({
        **{k[len("RELAY_"):].lower(): v for k, v in env.items() if k.startswith("RELAY_")},
        "upstream": "maildir:/tmp/x"})


def test_copied_sources_exist() -> None:
    """Every COPY from the build context names a file or folder of the repo."""
    for word, arg in dockerfile():
        if word == "COPY" and not arg.startswith("--from"):
            for src in arg.split()[:-1]:
                assert (REPO / src).exists(), src


def test_compose_relay_settings_are_valid() -> None:
    """The relay service's env names are settings, valid together, ports and scrape target match."""
    services = compose()["services"]
    assert isinstance(services, dict)
    assert {"relay", "redis", "prometheus", "grafana", "mailpit"} <= set(services)
    env = services["relay"]["environment"]
    assert relay_env_names(env) <= FIELDS
    Settings(**{k[len("RELAY_"):].lower(): v for k, v in env.items()})
    _, listen_port = split_host_port(env["RELAY_LISTEN"], what="listen")
    _, metrics_port = split_host_port(env["RELAY_METRICS_LISTEN"], what="metrics")
    published = {int(p.split(":")[-1]) for p in services["relay"]["ports"]}
    assert published == {listen_port, metrics_port}
    prom = yaml.safe_load((REPO / "config/prometheus/prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"relay:{metrics_port}"]
    assert prom["scrape_configs"][0]["job_name"] == "dedup-relay"  # the alert rules' job


def test_compose_redis_is_noeviction_with_aof() -> None:
    """The compose Redis never evicts fingerprints and persists them (design.md §3)."""
    command = " ".join(compose()["services"]["redis"]["command"])
    assert "--maxmemory-policy noeviction" in command
    assert "--appendonly yes" in command


def test_compose_mounts_exist() -> None:
    """Every host path compose mounts into a container exists in the repo."""
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), (name, source)


def test_prometheus_loads_the_rules_file_compose_mounts() -> None:
    """prometheus.yml's rule file is where compose mounts config/prometheus/alerts.yml."""
    prom = yaml.safe_load((REPO / "config/prometheus/prometheus.yml").read_text())
    mounts = compose()["services"]["prometheus"]["volumes"]
    targets = {v.split(":")[1] for v in mounts}
    assert set(prom["rule_files"]) <= targets


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the tests with exactly the command the README gives, and nothing else does."""
    pytest_line = re.compile(r"\.venv/bin/python -m pytest[^`\n\"]*")
    ci = [m.group(0).strip() for line in (REPO / ".ci/run").read_text().splitlines()
          if not line.lstrip().startswith(("#", "echo")) for m in [pytest_line.search(line)] if m]
    readme = {m.group(0).strip() for m in pytest_line.finditer((REPO / "README.md").read_text())}
    assert len(ci) == 1, ci
    assert readme == set(ci), (readme, ci)


def test_tests_share_parts_through_tests_support_only() -> None:
    """No test module imports a conftest or another test module, and no test or tool puts a
    folder on sys.path: shared parts live in tests/support/ and import as a package."""
    offenders = []
    for path in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "tools").glob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom | ast.Attribute):
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if last == "conftest" or last.startswith("test_"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
            if (isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} changes sys.path")
    assert offenders == []
