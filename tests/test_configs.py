"""Every shipped recipe parses, and takes the overrides the docs promise (recursive glob)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gqakit.uptrain.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p for p in CONFIGS.rglob("*.yaml") if "accelerate" not in p.parts)
ACCELERATE = sorted((CONFIGS / "accelerate").rglob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "stories260K-g2.yaml", "smollm2-135M-g1.yaml"} <= names
    assert {"single-gpu.yaml", "ddp.yaml", "fsdp.yaml"} <= {p.name for p in ACCELERATE}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_takes_overrides(recipe: Path, tmp_path: Path):
    text = recipe.read_text()
    assert text.startswith("#") and "gqakit uptrain configs/" in text.split("\n\n")[0], "open with the command"
    cfg = load_config(recipe, [f"model.path={tmp_path}/m", f"output.dir={tmp_path}/o", "train.tokens=1234", "train.seed=5"])
    assert (cfg.model.path, cfg.output.dir) == (f"{tmp_path}/m", f"{tmp_path}/o")
    assert (cfg.train.tokens, cfg.train.seed) == (1234, 5)


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_are_valid_yaml(path: Path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] in {"NO", "MULTI_GPU", "FSDP", "MULTI_CPU"}
    assert "num_processes" in cfg and "mixed_precision" in cfg
