"""docs/configuration.md is the schema's reference, generated (hpcserve.core.config_reference): it must be
up to date, every field must say what it does, and the example it shows must load."""

from __future__ import annotations

from pathlib import Path

import yaml

from hpcserve.core.config import parse_config
from hpcserve.core.config_reference import EXAMPLE, REGENERATE, render_reference, section_fields, section_models

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"


def test_the_doc_is_the_generated_reference():
    assert DOC.is_file(), f"{DOC} is missing: generate it with `{REGENERATE}`"
    assert DOC.read_text(encoding="utf-8") == render_reference(), (
        f"docs/configuration.md is stale (the config schema changed): regenerate it with `{REGENERATE}`")


def test_every_field_and_section_is_described():
    fields = section_fields()
    assert len(fields) > 60  # every section's fields are walked, not just the top level
    undescribed = [path for path, field in fields if not (field.description or "").strip()]
    assert undescribed == [], f"give these fields a description in src/hpcserve/core/config.py: {undescribed}"
    no_docstring = [model.__name__ for model in section_models() if not (model.__dict__.get("__doc__") or "").strip()]
    assert no_docstring == [], f"give these sections a class docstring: {no_docstring}"


def test_every_field_has_a_row():
    doc = render_reference()
    missing = [path for path, _ in section_fields() if f"| `{path}` |" not in doc]
    assert missing == []


def test_the_embedded_example_loads():
    cfg = parse_config(yaml.safe_load(EXAMPLE), source="config_reference.EXAMPLE")
    assert cfg.name == "local-tiny"
    assert cfg.model.path == "builtin:tiny-llama"


def test_every_table_row_has_four_cells():
    """A '|' in a description or a pattern is escaped, so no row splits into more columns."""
    rows = [line for line in render_reference().splitlines() if line.startswith("| `")]
    split = [row for row in rows if len(row.replace("\\|", "").strip("|").split("|")) != 4]
    assert rows and split == []
