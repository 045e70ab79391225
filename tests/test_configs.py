"""Every shipped recipe parses, takes the overrides the docs promise, holds no path of any
machine, and is found by name from any folder (`gqakit uptrain NAME`, `--list-configs`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gqakit.core.errors import GqakitError
from gqakit.uptrain.config import config_summary, load_config, missing_settings, packaged_configs, read_tree

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REPO = CONFIGS.parent
RECIPES = sorted(p for p in CONFIGS.rglob("*.yaml") if "accelerate" not in p.parts)
ACCELERATE = sorted((CONFIGS / "accelerate").rglob("*.yaml"))
# What each recipe leaves to the user: the paths only they know.
REQUIRED = {
    "tiny-cpu": ["model.path", "data.files"],
    "stories260K-g2": ["model.path", "teacher.path"],
    "stories260K-g2-lora": ["model.path", "teacher.path"],
    "smollm2-135M-g1": ["model.path", "data.files"],
    "t5-span-corruption": ["model.path", "data.files"],
}


def gqakit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gqakit", *args], capture_output=True, text=True, cwd=cwd)


def required_overrides(name: str, tmp_path: Path) -> list[str]:
    values = {"model.path": f"{tmp_path}/m", "teacher.path": f"{tmp_path}/t", "data.files": f"[{tmp_path}/d.txt]"}
    return [f"{k}={values[k]}" for k in REQUIRED[name]]


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "stories260K-g2.yaml", "smollm2-135M-g1.yaml"} <= names
    assert {"single-gpu.yaml", "ddp.yaml", "fsdp.yaml"} <= {p.name for p in ACCELERATE}
    assert set(packaged_configs()) == {p.stem for p in RECIPES} == set(REQUIRED)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_takes_overrides(recipe: Path, tmp_path: Path):
    text = recipe.read_text()
    assert text.startswith("#") and f"gqakit uptrain {recipe.stem} " in text.split("\nmodel:")[0], "open with the command"
    cfg = load_config(recipe.stem, [*required_overrides(recipe.stem, tmp_path), f"output.dir={tmp_path}/o",
                                    "train.tokens=1234", "train.seed=5"])
    assert (cfg.model.path, cfg.output.dir) == (f"{tmp_path}/m", f"{tmp_path}/o")
    assert (cfg.train.tokens, cfg.train.seed) == (1234, 5)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_holds_no_path_of_a_machine(recipe: Path):
    """Inputs come from overrides; only the run folder has a default, relative to the cwd."""
    text = recipe.read_text()
    for layout in ("/tmp", "../", "shared/", "~/.cache/gqakit/smollm2"):
        assert layout not in text, f"{recipe.name} mentions {layout!r}"
    tree = read_tree(recipe)
    assert missing_settings(tree) == REQUIRED[recipe.stem]
    assert tree["model"]["path"] is None
    assert (tree.get("teacher") or {}).get("path") is None and tree["data"].get("eval_file") is None
    assert not tree["data"].get("files")
    assert tree["output"]["dir"].startswith("runs/")


def test_missing_settings_are_named_together_in_one_line():
    with pytest.raises(GqakitError) as e:
        load_config("stories260K-g2")
    assert str(e.value) == "missing required settings: model.path, teacher.path (give them as key=value overrides)"
    with pytest.raises(GqakitError, match=r"^missing required settings: teacher.path \("):
        load_config("stories260K-g2", ["model.path=m"])
    with pytest.raises(GqakitError, match=r"^missing required settings: model.path, data.files \("):
        load_config("tiny-cpu")
    # the distillation switched off, the teacher is no longer needed (its samples still are)
    with pytest.raises(GqakitError, match=r"^missing required settings: teacher.path \("):
        load_config("stories260K-g2", ["model.path=m", "teacher.kl_weight=0", "teacher.hidden_weight=0",
                                       "teacher.lm_weight=1"])


def test_a_name_is_a_shipped_recipe_from_any_folder_and_a_file_wins(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny-cpu", ["model.path=m", "data.files=[d.txt]"])
    assert cfg.train.seq_len == 64 and cfg.output.dir == "runs/tiny-cpu"
    # an existing file of that name is the user's config, not the shipped one
    (tmp_path / "tiny-cpu").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"texts": ["a"]},
                                                       "train": {"tokens": 9}, "output": {"dir": "o"}}))
    assert load_config("tiny-cpu").train.tokens == 9
    with pytest.raises(GqakitError, match=r"no shipped config named 'tiny-cpuu'; did you mean 'tiny-cpu'\?"):
        load_config("tiny-cpuu")
    with pytest.raises(GqakitError, match="config file not found"):
        load_config("tiny-cpu.yaml")  # a file name is a file, never looked up


def test_list_configs_names_each_with_its_first_comment_line(tmp_path: Path):
    r = gqakit("uptrain", "--list-configs", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert set(rows) == set(REQUIRED)
    for name, path in packaged_configs().items():
        first = path.read_text().splitlines()[0]
        assert rows[name] == first.lstrip("# ") == config_summary(path) and len(first) <= 100
    assert "distilled" in rows["stories260K-g2"]


def test_stories_recipe_says_the_method_its_command_uses():
    """The convert command in the comment uses the default method (align); the text says so."""
    from gqakit.convert.settings import DEFAULT_METHOD

    for name in ("stories260K-g2", "stories260K-g2-lora"):
        head = (CONFIGS / f"{name}.yaml").read_text().split("\nmodel:")[0]
        convert = next(ln for ln in head.splitlines() if "gqakit convert" in ln)
        assert "--method" not in convert and f"`{DEFAULT_METHOD}` (gqakit convert's default" in head
        assert "mean pooling" not in head


def test_dry_run_of_a_shipped_recipe_from_an_empty_folder(tiny_model, tmp_path: Path):
    """`gqakit uptrain stories260K-g2 model.path=... --dry-run` from a folder with nothing in
    it: every check passes, and nothing printed names the repository."""
    from gqakit.convert import convert_checkpoint

    mha = tiny_model("llama", num_attention_heads=8, num_key_value_heads=8)
    g2 = convert_checkpoint(mha, tmp_path / "g2", 2, method="mean", progress=False)
    held = tmp_path / "held.txt"
    held.write_text("a b c d e f g\n" * 50)
    cwd = tmp_path / "empty"
    cwd.mkdir()
    r = gqakit("uptrain", "stories260K-g2", f"model.path={g2}", f"teacher.path={mha}", f"data.eval_file={held}",
               "train.seq_len=64", "--dry-run", cwd=cwd)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["model"]["path"] == str(g2) and cfg["output"]["dir"] == "runs/s260k-g2"
    assert "# schedule: 15625 steps of 128 tokens" in r.stdout and "# memory plan per process" in r.stdout
    assert str(REPO) not in r.stdout + r.stderr and "shared" not in r.stdout + r.stderr
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_are_valid_yaml(path: Path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] in {"NO", "MULTI_GPU", "FSDP", "MULTI_CPU"}
    assert "num_processes" in cfg and "mixed_precision" in cfg
