"""Model cards (README.md) that record how a folder was made."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import gqakit


def render_model_card(*, title: str, base_model: str | None, summary: str, facts: dict[str, Any],
                      settings: dict[str, Any], use_it: str | None = None) -> str:
    """A Hugging Face model card: YAML front matter, a facts table and the exact settings.

    `base_model` must be a Hub id (`org/name`, `@revision` when not main), as the model-card
    spec reads it; None leaves it out (a local source with no Hub id: never a local path)."""
    front: dict[str, Any] = {"library_name": "transformers", "tags": ["gqa", "gqakit"]}
    if base_model:
        front["base_model"] = base_model
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", "", summary, ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    if use_it:
        lines += ["", "## Use it", "", use_it.strip()]
    lines += ["", f"Made with gqakit {gqakit.__version__}. Exact settings:", "", "```json", json.dumps(settings, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def use_it_body(*, remote_code: bool, encoder_decoder: bool = False, gguf_arch: str | None = None,
                vllm: bool = True) -> str:
    """The card's "Use it" section: how transformers, vLLM and llama.cpp load the folder (OUT),
    and the command that checks an engine serves it (`gqakit eval OUT --engine ENGINE --check`).

    `remote_code`: the folder carries gqakit's modeling file (trust_remote_code=True);
    `encoder_decoder`: AutoModelForSeq2SeqLM; `gguf_arch`: the GGUF architecture llama.cpp runs
    the family as (None: llama.cpp is not offered); `vllm`: vLLM has a class that reads the
    folder's KV heads (False: vLLM is not offered, and the check runs on transformers)."""
    trc = ", trust_remote_code=True" if remote_code else ""
    auto = "AutoModelForSeq2SeqLM" if encoder_decoder else "AutoModelForCausalLM"
    out = ["`OUT` is this folder (a path, or its Hub id once uploaded).", "",
           "**transformers** (" + ("gqakit's modeling file ships in the folder, so it loads with "
                                   "`trust_remote_code=True`" if remote_code else "the stock class") + "):", "",
           "```python", f"from transformers import AutoTokenizer, {auto}", "",
           f'model = {auto}.from_pretrained("OUT"{trc})',
           f'tokenizer = AutoTokenizer.from_pretrained("OUT"{trc})',
           'ids = tokenizer("Once upon a time", return_tensors="pt").input_ids',
           "print(tokenizer.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0]))", "```", ""]
    if encoder_decoder:
        out += ["**vLLM** and **llama.cpp**: see gqakit's docs/serving.md for the encoder-decoders each engine "
                "serves.", ""]
    else:
        flag = " --trust-remote-code" if remote_code else ""
        out += (["**vLLM**:", "", "```bash", f"vllm serve OUT{flag}", "```", "", "```python", "from vllm import LLM",
                 "", f'llm = LLM("OUT"{trc})', 'print(llm.generate(["Once upon a time"])[0].outputs[0].text)', "```", ""]
                if vllm else ["**vLLM** has no class that reads this folder's KV heads (`gqakit eval --engine vllm` "
                              "refuses it; gqakit's docs/serving.md lists what vLLM serves).", ""])
        if gguf_arch:
            out += ["**llama.cpp** (a GGUF file: convert the source's GGUF with gqakit, `gqakit convert SRC.gguf "
                    "OUT.gguf -g G`, or this folder with llama.cpp's own `convert_hf_to_gguf.py OUT --outfile "
                    "OUT.gguf`):", "", "```bash", 'llama-cli -m OUT.gguf -p "Once upon a time" -n 20', "```", ""]
        out += ["**Check that an engine serves it** (greedy tokens against transformers, and the KV cache the "
                "engine allocates against gqakit's prediction; PASS or FAIL):", "", "```bash",
                f"gqakit eval OUT --engine {'vllm' if vllm else 'transformers'} --check --out check.json"]
        if gguf_arch:
            out += ["gqakit eval OUT.gguf --engine llama.cpp --check --out check-gguf.json"]
        out += ["```"]
    return "\n".join(out)


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
