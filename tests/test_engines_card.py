"""The convert card's "Use it" section: transformers, vLLM and llama.cpp commands and the serving
check, and the transformers snippet runs as written on a converted folder."""

from __future__ import annotations

import re

import pytest

import gqakit

pytestmark = pytest.mark.usefixtures("one_thread")


def card_of(tiny_model, tmp_path, family: str, **overrides) -> tuple[str, str]:
    out = tmp_path / f"{family}-g2"
    gqakit.convert(tiny_model(family, **overrides), out, num_kv_heads=2, quiet=True)
    return (out / "README.md").read_text(), str(out)


def python_block(card: str) -> str:
    section = card.split("## Use it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_snippet(code: str, out: str, capsys) -> str:
    capsys.readouterr()
    exec(compile(code.replace('"OUT"', repr(out)), "card", "exec"), {})
    return capsys.readouterr().out


@pytest.mark.parametrize("family, remote", [("llama", False), ("gpt2", True)])
def test_card_says_how_each_engine_loads_it_and_the_snippet_runs(tiny_model, tmp_path, capsys, family, remote):
    card, out = card_of(tiny_model, tmp_path, family)
    use = card.split("## Use it", 1)[1].split("Made with gqakit", 1)[0]
    trc = ", trust_remote_code=True" if remote else ""
    assert f'AutoModelForCausalLM.from_pretrained("OUT"{trc})' in use
    # vLLM has no class for a folder with gqakit's gpt2 file (its engine refuses it): not offered
    assert ("vllm serve" in use) is (not remote) and ("LLM(" in use) is (not remote)
    assert ("vllm serve OUT\n" in use) is (not remote)
    engine = "transformers" if remote else "vllm"
    assert f"gqakit eval OUT --engine {engine} --check --out check.json" in use
    # llama.cpp is offered where the family has a GGUF architecture in the table (llama: yes, gpt2: no)
    assert ("llama-cli -m OUT.gguf" in use) is (not remote)
    assert ("--engine llama.cpp --check" in use) is (not remote)
    printed = run_snippet(python_block(card), out, capsys)
    assert printed.strip()  # the snippet generated and decoded text
