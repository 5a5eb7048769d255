"""docs/settings.md is what ``python -m relay.settings.doc`` makes of the settings now: a setting
added, renamed or redescribed in its section fails this test until the page is written again."""

from __future__ import annotations

from pathlib import Path

from relay.settings import FILE_ONLY_SETTINGS, Settings, env_name
from relay.settings import doc as settings_doc

REPO = Path(__file__).resolve().parents[2]


def test_docs_settings_md_is_generated_from_the_settings() -> None:
    """Run ``python -m relay.settings.doc`` when this fails."""
    assert (REPO / "docs" / "settings.md").read_text(encoding="utf-8") == settings_doc.render()


def test_every_setting_has_a_row_with_its_env_var_and_a_description() -> None:
    """Each field's row names its env var and carries its description (the --help text)."""
    page = settings_doc.render()
    for name, field in Settings.model_fields.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"`{env_name(name)}`" in row
        assert field.description, name
        assert ("(file only)" in row) == (name in FILE_ONLY_SETTINGS)
