"""MkDocs hooks of the docs site (mkdocs.yml ``hooks``): the site's home page is the README.

``docs/index.md`` holds one line; :func:`on_page_markdown` serves README.md in its place, its
links into ``docs/`` made relative to the site (``docs/ledger.md`` -> ``ledger.md``), so the
front door is written once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def home_markdown(readme: str) -> str:
    """README.md's text as the site's home page: links into ``docs/`` made relative to it, and
    the link to the docs tree itself pointing at the site's pages."""
    return readme.replace("](docs/index.md)", "](#documentation)").replace("](docs/", "](")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """The README for the home page (``index.md``); every other page as written."""
    if page.file.src_uri == "index.md":
        return home_markdown(README.read_text(encoding="utf-8"))
    return markdown
