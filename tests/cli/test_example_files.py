"""``dedup-relay example config|dashboard|alerts|systemd`` prints the operator files that ship with
the package, byte for byte as the repository holds them; a wheel built from the checkout carries
them (not links), so an installed relay needs no checkout; the printed config feeds
``check-config`` as it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from relay.cli.example import EXAMPLES
from tests.support.cli import REPO

REPOSITORY_FILES = {
    "config": REPO / "config" / "dedup-relay.example.toml",
    "dashboard": REPO / "grafana" / "dashboards" / "dedup-relay.json",
    "alerts": REPO / "config" / "prometheus" / "alerts.yml",
    "systemd": REPO / "contrib" / "systemd" / "dedup-relay.service",
}


def example(name: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.run([sys.executable, "-m", "relay", "example", name], cwd=cwd, env=env,
                          capture_output=True, timeout=60, check=False)


@pytest.mark.parametrize("name", list(REPOSITORY_FILES))
def test_each_example_is_the_repositorys_file(name: str, tmp_path: Path) -> None:
    printed = example(name, tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == REPOSITORY_FILES[name].read_bytes()


def test_an_unknown_example_is_a_usage_error(tmp_path: Path) -> None:
    printed = example("nginx", tmp_path)
    assert printed.returncode == 2 and b"config" in printed.stderr


def test_the_printed_config_passes_check_config(tmp_path: Path) -> None:
    """What an operator starts from is valid as it is (its upstream given, as the file says)."""
    (tmp_path / "relay.toml").write_bytes(example("config", tmp_path).stdout)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    checked = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "--config", "relay.toml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr
    assert "configuration ok" in checked.stdout


def build_wheel(source: Path, into: Path) -> zipfile.ZipFile:
    """The wheel of ``source`` (a checkout or an sdist) built as the image builds it (no build
    isolation, no dependency), its operator files checked byte for byte against the
    repository's."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(into), str(source)],
        capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr
    [wheel] = into.glob("dedup_relay-*.whl")
    archive = zipfile.ZipFile(wheel)
    for name, path in REPOSITORY_FILES.items():
        member = f"relay/operator_files/{EXAMPLES[name]}"
        assert archive.read(member) == path.read_bytes(), member
    return archive


def test_a_wheel_carries_the_files_themselves(tmp_path: Path) -> None:
    build_wheel(REPO, tmp_path).close()


def test_an_sdist_carries_tests_and_documents_and_builds_the_wheel(tmp_path: Path) -> None:
    """The sdist holds the tests, README, LICENSE and CHANGELOG and the operator files; a wheel
    built from it (not from the checkout) still carries them, declares its license and
    requires version ranges (installable beside other pins), asyncpg only with ``postgres``."""
    tree = tmp_path / "tree"  # the checkout as it is, links kept, no venv or caches
    shutil.copytree(REPO, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache",
        "*.egg-info", "site", "data", "maildir"))
    sdist = subprocess.run(
        [sys.executable, "-c", "import setuptools.build_meta as b; "
         f"print(b.build_sdist({str(tmp_path)!r}))"],
        cwd=tree, capture_output=True, text=True, timeout=300, check=False)
    assert sdist.returncode == 0, sdist.stderr
    [archive] = tmp_path.glob("dedup_relay-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"README.md", "LICENSE", "CHANGELOG.md", "tests/cli/test_example_files.py",
            *(f"relay/operator_files/{f}" for f in EXAMPLES.values())} <= names
    with build_wheel(archive, tmp_path / "wheels") as whl:
        [metadata] = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    pinned = [r for r in requires if "==" in r.split(";")[0]]  # the marker's extra == "x" aside
    assert requires and not pinned, pinned  # ranges, not pins
    assert {"Provides-Extra: postgres", "Provides-Extra: fast"} <= set(meta.splitlines())
    assert any("asyncpg" in r and "extra == \"postgres\"" in r for r in requires)
