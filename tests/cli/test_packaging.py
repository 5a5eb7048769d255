"""What can be checked of the Docker image and the compose stack without a Docker engine:
the commands the image runs exist, ports and env names match the settings, files it mounts
exist, the store is configured as design.md §3 asks."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from relay.cli.group import main as cli_main
from relay.settings import Settings, load_settings, split_host_port

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


# --- the lock files (tools/relock.sh writes them from pyproject.toml) -------------------------

# lock: the extras it covers (the image and CI run the relay with every extra of its own)
LOCKS = {"requirements.lock": ("postgres", "fast"),
         "requirements-dev.lock": ("dev", "postgres", "fast")}
LOCK_LINE = re.compile(r"^(?P<req>[A-Za-z0-9][A-Za-z0-9._-]*==[^\s\\]+(?: ; [^\\]+?)?) *\\?$")


def lock_pins(text: str) -> dict[str, Requirement]:
    """The ``name==version ; marker`` lines of a lock file by canonical name; raises
    AssertionError for a pin without a sha256 hash or a name pinned twice."""
    pins: dict[str, Requirement] = {}
    current: str | None = None
    hashed: set[str] = set()
    for line in text.splitlines():
        found = LOCK_LINE.match(line)
        if found:
            req = Requirement(found.group("req"))
            current = canonicalize_name(req.name)
            assert current not in pins, f"{current} pinned twice"
            pins[current] = req
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            hashed.add(current)
    assert pins and hashed == set(pins), f"pins without a hash: {set(pins) - hashed}"
    return pins


def pinned_version(req: Requirement) -> str:
    """The version of a lock line's ``==`` pin."""
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def lock_problems(project: dict[str, Any], extras: tuple[str, ...], lock_text: str) -> list[str]:
    """What the lock misses of pyproject.toml (parsed): every runtime dependency, every
    dependency of ``extras`` and of [build-system] requires pinned at a version its specifier
    admits and with the same environment marker (uvloop: not on Windows)."""
    pins = lock_pins(lock_text)
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in extras:
        wanted += project["project"]["optional-dependencies"][extra]
    problems = []
    for line in wanted:
        req = Requirement(line)
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name}: not in the lock")
        elif not req.specifier.contains(pinned_version(pin), prereleases=True):
            problems.append(f"{req.name}: locked {pinned_version(pin)}, pyproject {req.specifier}")
        elif str(pin.marker or "") != str(req.marker or ""):
            problems.append(f"{req.name}: lock marker {pin.marker}, pyproject {req.marker}")
    return problems


def pyproject() -> dict[str, Any]:
    """pyproject.toml parsed."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_locks_pin_every_dependency_of_pyproject() -> None:
    """requirements.lock holds the runtime dependencies and the build backend, and
    requirements-dev.lock those and the dev extra, each at pyproject.toml's version with its
    marker and a hash: a dependency added or bumped without tools/relock.sh fails here."""
    for name, extras in LOCKS.items():
        assert lock_problems(pyproject(), extras, (REPO / name).read_text()) == [], name


def test_lock_check_catches_a_dependency_added_without_relocking() -> None:
    """The check above reports a new dependency, a bumped pin and a changed marker."""
    project = pyproject()
    deps = [d for d in project["project"]["dependencies"] if not d.startswith("click")]
    project["project"]["dependencies"] = [*deps, "click>=9", "rich==14.0.0"]
    fast = project["project"]["optional-dependencies"]["fast"]
    project["project"]["optional-dependencies"]["fast"] = [
        d.split(";")[0] if d.startswith("uvloop") else d for d in fast]
    problems = lock_problems(project, ("postgres", "fast"),
                             (REPO / "requirements.lock").read_text())
    assert [p.split(":")[0] for p in problems] == ["click", "rich", "uvloop"], problems


def test_runtime_lock_is_the_dev_lock_less_the_dev_tools() -> None:
    """Both locks agree on every version they share (the image runs what CI tested), and the
    runtime lock holds none of the dev extra's tools."""
    runtime = lock_pins((REPO / "requirements.lock").read_text())
    dev = lock_pins((REPO / "requirements-dev.lock").read_text())
    assert set(runtime) <= set(dev)
    assert {n: str(r) for n, r in runtime.items()} == {n: str(dev[n]) for n in runtime}
    dev_tools = {canonicalize_name(Requirement(d).name)
                 for d in pyproject()["project"]["optional-dependencies"]["dev"]}
    assert not dev_tools & set(runtime)


def test_ci_installs_from_the_dev_lock_with_hashes() -> None:
    """.ci/run installs requirements-dev.lock with --require-hashes, then the project itself
    with --no-deps (nothing resolved outside the lock), and runs pip check."""
    lines = [line for line in (REPO / ".ci/run").read_text().splitlines()
             if ".venv/bin/pip " in line and not line.lstrip().startswith(("#", "echo"))]
    assert len(lines) == 3, lines
    assert "--require-hashes" in lines[0] and "-r requirements-dev.lock" in lines[0]
    assert "--no-deps" in lines[1] and lines[1].rstrip().endswith("-e .")
    assert lines[2].split() == [".venv/bin/pip", "check"]


# --- the image: dependency layer, labels ----------------------------------------------------

def test_image_installs_the_lock_before_the_source() -> None:
    """The build stage copies and installs requirements.lock (hashes required) before any COPY
    of relay/, then installs the project with --no-deps: a change under relay/ rebuilds only
    the last layers, never the dependencies."""
    steps = dockerfile()
    build = steps[:max(i for i, (w, _) in enumerate(steps) if w == "FROM")]
    copies = [i for i, (w, a) in enumerate(build) if w == "COPY"]
    lock_copy = next(i for i in copies if build[i][1].split()[:-1] == ["requirements.lock"])
    source_copy = next(i for i in copies if "relay" in build[i][1].split()[:-1])
    runs = [(i, a) for i, (w, a) in enumerate(build) if w == "RUN"]
    deps_run = next(i for i, a in runs if "-r requirements.lock" in a)
    assert "--require-hashes" in build[deps_run][1]
    assert lock_copy < deps_run < source_copy
    assert all(w != "COPY" for w, _ in build[lock_copy + 1:deps_run])
    project_runs = [a for i, a in runs if i > source_copy and "pip install" in a]
    assert project_runs and all("--no-deps" in a for a in project_runs)


def test_image_has_the_oci_labels() -> None:
    """The final stage's OCI labels: title, description and licenses as pyproject.toml says,
    version from a build ARG that defaults to pyproject's version, revision, created and
    source from build ARGs."""
    steps = dockerfile()
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    labels = dict(item.split("=", 1) for w, a in final if w == "LABEL" for item in shlex.split(a))
    args = dict(a.split("=", 1) for w, a in final if w == "ARG")
    meta = pyproject()["project"]
    oci = "org.opencontainers.image."
    assert labels[oci + "title"] == meta["name"]
    assert labels[oci + "description"] == meta["description"]
    assert labels[oci + "licenses"] == meta["license"]
    assert labels[oci + "version"] == "${VERSION}" and args["VERSION"] == meta["version"]
    for key, arg in (("revision", "REVISION"), ("created", "CREATED"), ("source", "SOURCE")):
        assert labels[oci + key] == f"${{{arg}}}" and arg in args


# --- deploy/kubernetes/ ---------------------------------------------------------------------

KUBERNETES = REPO / "deploy" / "kubernetes"


def kubernetes_objects() -> dict[str, dict[str, Any]]:
    """The objects of deploy/kubernetes/ by kind (one of each): the kustomization's resources,
    the example Secret, the monitoring kustomization's."""
    files = [KUBERNETES / name for name in kustomization(KUBERNETES)["resources"]]
    files += [KUBERNETES / "secret.example.yaml"]
    files += [KUBERNETES / "monitoring" / name
              for name in kustomization(KUBERNETES / "monitoring")["resources"]]
    objects = [o for f in files for o in yaml.safe_load_all(f.read_text()) if o]
    by_kind = {o["kind"]: o for o in objects}
    assert len(by_kind) == len(objects) and {
        "Deployment", "Secret", "Service", "PodDisruptionBudget", "ServiceMonitor",
        "PrometheusRule"} <= set(by_kind)
    return by_kind


def kustomization(folder: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return loaded


def test_kubernetes_pod_passes_the_restricted_pod_security_standard() -> None:
    """The checks of the "restricted" profile (kubernetes.io/docs/concepts/security/
    pod-security-standards): non-root, RuntimeDefault seccomp, no privilege escalation, every
    capability dropped, no host namespaces or paths; and a read-only root file system."""
    pod = kubernetes_objects()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["readOnlyRootFilesystem"] is True
        assert context.get("privileged") is not True


def test_kubernetes_config_map_and_disruption_budget() -> None:
    """The kustomization makes the ConfigMap the Deployment mounts (RELAY_CONFIG names its
    file) and the PodDisruptionBudget covers the Deployment's pods, one away at a time."""
    objects = kubernetes_objects()
    (generated,) = kustomization(KUBERNETES)["configMapGenerator"]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == generated["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    (file,) = generated["files"]
    assert env["RELAY_CONFIG"] == f"{mount['mountPath']}/{file}"
    load_settings({"upstream": "127.0.0.1:25"}, KUBERNETES / file)  # a valid settings file
    budget = objects["PodDisruptionBudget"]["spec"]
    assert budget["selector"] == objects["Deployment"]["spec"]["selector"]
    assert budget["maxUnavailable"] == 1


def test_kubernetes_prometheus_rule_is_the_shipped_alert_rules() -> None:
    """The PrometheusRule holds exactly the groups of config/prometheus/alerts.yml (run
    tools/prometheus_rule.py after changing them), and the
    ServiceMonitor scrapes the Service's metrics port."""
    objects = kubernetes_objects()
    alerts = yaml.safe_load((REPO / "config" / "prometheus" / "alerts.yml").read_text())
    assert objects["PrometheusRule"]["spec"]["groups"] == alerts["groups"]
    (endpoint,) = objects["ServiceMonitor"]["spec"]["endpoints"]
    ports = {p["name"] for p in objects["Service"]["spec"]["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def test_kubernetes_validate_refuses_an_unknown_field(tmp_path: Path) -> None:
    """The CI step's validator (kubernetes-validate --strict) is no rubber stamp: the shipped
    Deployment with one misspelt field is refused."""
    broken = tmp_path / "deployment.yaml"
    broken.write_text((KUBERNETES / "deployment.yaml").read_text().replace(
        "terminationGracePeriodSeconds", "terminationGracePeriodSecond"))
    validate = Path(sys.executable).with_name("kubernetes-validate")
    done = subprocess.run([str(validate), "--strict", str(broken)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode != 0, done.stdout


def test_kubernetes_relays_share_one_redis_and_one_secret() -> None:
    """The Deployment runs several replicas on one Redis store, its RELAY_* variables are
    settings valid together, the secrets are files of the Secret's volume, RELAY_WORKERS is
    the CPU limit, and the allowed networks are not only loopback."""
    objects = kubernetes_objects()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert objects["Deployment"]["spec"]["replicas"] >= 2
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env.pop("RELAY_CONFIG").startswith("/")  # the ConfigMap's file (checked below)
    assert relay_env_names(env) <= FIELDS
    settings = Settings.model_validate({k[len("RELAY_"):].lower(): v for k, v in env.items()})
    assert settings.store.startswith("redis://")
    assert settings.effective_workers == int(container["resources"]["limits"]["cpu"])
    assert "127.0.0.0/8" not in settings.allowed_networks
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    secret = objects["Secret"]
    assert secret_volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret_volume["name"])
    for field in ("upstream_password_file", "fingerprint_secret_file"):
        path = Path(getattr(settings, field))
        assert path.parent == Path(mount["mountPath"]) and path.name in secret["stringData"]
    assert Path(settings.settle_journal).is_absolute()


def test_kubernetes_probes_grace_and_service_match_the_settings() -> None:
    """Readiness on /readyz and liveness on /healthz of the metrics port, a grace period above
    the supervisor's own bound on a worker's shutdown, a Service on the SMTP port, and the
    scrape annotations on the metrics port."""
    objects = kubernetes_objects()
    template = objects["Deployment"]["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    _, listen_port = split_host_port(env["RELAY_LISTEN"], what="listen")
    _, metrics_port = split_host_port(env["RELAY_METRICS_LISTEN"], what="metrics")
    assert ports == {"smtp": listen_port, "metrics": metrics_port}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and ports[get["port"]] == metrics_port
    defaults = {n: f.default for n, f in Settings.model_fields.items()}
    bound = defaults["shutdown_grace"] + 4 * defaults["store_timeout"] + 10.0
    assert pod["terminationGracePeriodSeconds"] > bound
    service = objects["Service"]["spec"]
    assert service["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]
    by_name = {p["name"]: p for p in service["ports"]}
    assert by_name["smtp"]["port"] == listen_port
    assert ports[by_name["smtp"]["targetPort"]] == listen_port
    assert ports[by_name["metrics"]["targetPort"]] == metrics_port
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == metrics_port
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user (Dockerfile)
