"""Model cards (README.md) that record how a folder was made."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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


def set_section(card: Path, heading: str, body: str) -> None:
    """Like `append_section`, but a `## heading` section the card already has is taken out
    first (the text up to the next `## ` heading), so the card keeps one, at its end."""
    if card.exists():
        lines = card.read_text().rstrip().split("\n")
        start = next((i for i, line in enumerate(lines) if line.strip() == f"## {heading}"), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            card.write_text("\n".join(lines[:start] + lines[end:]).rstrip() + "\n")
    append_section(card, heading, body)


def lineage_body(steps: Sequence[Mapping[str, Any]]) -> str:
    """The `Lineage` section: one numbered line per step that made the weights, oldest first.

    Each step is a mapping with `step` (what happened: "source", "conversion", "uptraining")
    and the facts that say how; `None` values are left out."""
    lines = ["How these weights were made, from the original model to this folder:", ""]
    for i, st in enumerate(steps, 1):
        facts = "; ".join(" ".join(f"{k} {v}".split()) for k, v in st.items() if k != "step" and v is not None)
        lines.append(f"{i}. **{' '.join(str(st['step']).split())}**" + (f": {facts}" if facts else ""))
    return "\n".join(lines)
