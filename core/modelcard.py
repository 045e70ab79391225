"""Model cards (README.md) that record how a folder was made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

import gqakit


def render_model_card(*, title: str, base_model: str | None, summary: str, facts: dict[str, Any],
                      settings: dict[str, Any]) -> str:
    """A Hugging Face model card: YAML front matter, a facts table and the exact settings.

    `base_model` must be a Hub id (`org/name`, `@revision` when not main), as the model-card
    spec reads it; None leaves it out (a local source with no Hub id: never a local path)."""
    front: dict[str, Any] = {"library_name": "transformers", "tags": ["gqa", "gqakit"]}
    if base_model:
        front["base_model"] = base_model
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", "", summary, ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += ["", f"Made with gqakit {gqakit.__version__}. Exact settings:", "", "```json", json.dumps(settings, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def append_section(card: Path, heading: str, body: str) -> None:
    """Append a `## heading` section to an existing model card (or start one)."""
    text = card.read_text() if card.exists() else f"# {card.parent.name}\n"
    card.write_text(text.rstrip() + f"\n\n## {heading}\n\n{body.strip()}\n")
