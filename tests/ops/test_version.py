"""One version: pyproject.toml's, read through the installed metadata by ``relay.__version__``,
``dedup-relay --version`` and the ``relay_build_info`` metric."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import relay
from tests.support.cli import REPO, run_cli
from tests.support.metrics import ServedRelay, scrape

RELAY_INIT = REPO / "relay" / "__init__.py"


def pyproject_version(path: Path = REPO / "pyproject.toml") -> str:
    """``[project] version`` of a pyproject.toml."""
    return str(tomllib.loads(path.read_text())["project"]["version"])


def test_the_version_is_the_same_everywhere(served_relay: ServedRelay, tmp_path: Path) -> None:
    """pyproject.toml, the installed metadata, relay.__version__, `--version` (module and
    console script) and relay_build_info{version} of a serving relay agree."""
    expected = pyproject_version()
    assert version("dedup-relay") == expected, "stale metadata: pip install -e . again"
    assert relay.__version__ == expected
    by_module = run_cli("--version", cwd=tmp_path)
    assert by_module.returncode == 0 and by_module.stdout == f"dedup-relay, version {expected}\n"
    script = Path(sys.executable).with_name("dedup-relay")
    by_script = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                               timeout=60, check=False)
    assert by_script.stdout == f"dedup-relay, version {expected}\n", by_script.stderr
    (labels, _), = scrape(served_relay.metrics_port)["relay_build_info"]
    assert labels == {"version": expected}


def version_in_bare_tree(tree: Path) -> str:
    """``relay.__version__`` imported from ``tree`` by an interpreter without site-packages
    (``-S``), so no installed distribution metadata is found."""
    probe = ("import importlib.metadata as m, sys\n"
             "try:\n"
             "    m.version('dedup-relay')\n"
             "    sys.exit('metadata found: the probe is not metadata-free')\n"
             "except m.PackageNotFoundError:\n"
             "    pass\n"
             f"sys.path.insert(0, {str(tree)!r})\n"
             "import relay\n"
             "print(relay.__version__)\n")
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tree, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_source_tree_without_metadata_reads_pyproject(tmp_path: Path) -> None:
    """Without installed metadata the version is the pyproject.toml beside the package; with
    another project's pyproject.toml (or none) it is 0+unknown."""
    (tmp_path / "relay").mkdir()
    (tmp_path / "relay" / "__init__.py").write_text(RELAY_INIT.read_text())
    assert version_in_bare_tree(tmp_path) == "0+unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "1.2.3"\n')
    assert version_in_bare_tree(tmp_path) == "0+unknown"
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "dedup-relay"\nversion = "9.8.7"\n')
    assert version_in_bare_tree(tmp_path) == "9.8.7"
