"""The commands README.md and the user docs show are commands gqakit accepts: every verb
exists and every flag an example uses is one of that verb's options (what `--help` lists),
and the user's part of README names no path of this repository's surroundings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from gqakit.cli import VERBS, cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S)


def gqakit_commands(text: str) -> list[list[str]]:
    """Each `gqakit ...` command of the page's shell blocks, continuation lines joined,
    comments and environment assignments dropped, split as the shell would."""
    out = []
    for block in shell_blocks(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" # ", 1)[0].split("  #", 1)[0].strip()
            words = shlex.split(line, comments=True) if line else []
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words[:3] == ["accelerate", "launch", "--config_file"]:
                words = words[words.index("gqakit"):] if "gqakit" in words else []
            if words and words[0] == "gqakit":
                out.append(words)
    return out


def options_of(verb: str) -> set[str]:
    ctx = click.Context(cli)
    cmd = cli.get_command(ctx, verb)
    assert cmd is not None, f"no verb {verb}"
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


@pytest.mark.parametrize("page", PAGES)
def test_every_example_uses_a_real_verb_and_real_flags(page: str) -> None:
    commands = gqakit_commands((ROOT / page).read_text())
    if page == "README.md":
        assert len(commands) >= 5, "README shows gqakit commands"
    for words in commands:
        if len(words) == 1 or words[1] in ("--help", "-h", "--version"):
            continue
        verb = words[1]
        assert verb in VERBS, f"{page}: `{' '.join(words)}`: no verb {verb!r}"
        known = options_of(verb)
        for w in words[2:]:
            if w.startswith("-") and w != "-":
                flag = w.split("=", 1)[0]
                assert flag in known, f"{page}: `{' '.join(words)}`: {verb} has no option {flag}"


def test_readme_user_section_is_short_and_names_no_repository_surroundings() -> None:
    text = (ROOT / "README.md").read_text()
    head, sep, _ = text.partition("\n## Development")
    assert sep, "README has a Development section"
    assert len(head.splitlines()) < 150, "README's user section stays under 150 lines"
    assert "../shared" not in head and "/tmp/" not in head
    lines = text.splitlines()
    first_block = next(i for i, ln in enumerate(lines) if ln.startswith("```"))
    assert lines[first_block + 1].startswith("bash scripts/demo.sh")
    assert lines[first_block + 2].startswith("bash scripts/test.sh")
    dev = text[text.index("\n## Development"):]
    dev_block = shell_blocks(dev)[0].splitlines()
    assert dev_block[0].startswith("bash scripts/demo.sh") and dev_block[1].startswith("bash scripts/test.sh")


def test_the_extractor_sees_flags_and_would_catch_a_wrong_one() -> None:
    cmds = gqakit_commands("```bash\nHF_HUB_OFFLINE=0 gqakit convert a b \\\n   -g 1  # note\n```\n")
    assert cmds == [["gqakit", "convert", "a", "b", "-g", "1"]]
    assert "-g" in options_of("convert") and "--no-such-flag" not in options_of("convert")
