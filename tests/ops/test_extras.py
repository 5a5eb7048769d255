"""The ``tools`` extra: matplotlib is installed for tools/render_dashboard.py only, so the dev
extras (what the tests need) stay without it."""

from __future__ import annotations

import ast
import tomllib

from tests.support.cli import REPO


def importers_of(module: str, folders: tuple[str, ...]) -> list[str]:
    """Python files under ``folders`` (repo-relative) that import ``module`` or a submodule."""
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == module or n.startswith(module + ".") for n in names):
                    found.append(str(path.relative_to(REPO)))
                    break
    return found


def test_matplotlib_is_in_the_tools_extra_and_used_by_tools_only() -> None:
    """matplotlib is in ``tools`` (a range, as every dependency of the package), absent from
    ``dev``, and imported by tools/ alone."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert [d for d in extras["tools"] if d.startswith("matplotlib")] == ["matplotlib>=3.11.2,<4"]
    assert not [d for d in extras["dev"] if d.startswith("matplotlib")]
    assert importers_of("matplotlib", ("relay", "tests")) == []
    assert importers_of("matplotlib", ("tools",)) == ["tools/render_dashboard.py"]
