"""Config loading: YAML/dict, dotted overrides, one clear error naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gqakit.core.errors import GqakitError
from gqakit.uptrain.config import apply_overrides, load_config

BASE = {
    "model": {"path": "/m"},
    "data": {"texts": ["a b c"]},
    "train": {"tokens": 1000, "seq_len": 16, "micro_batch": 2},
    "output": {"dir": "/o"},
}


def test_dict_config_and_defaults():
    cfg = load_config(BASE)
    assert cfg.train.grad_accum == 1 and cfg.teacher.kl_weight == 0 and cfg.train.budget() == 1000


def test_overrides_set_values_and_parse_numbers():
    cfg = load_config(BASE, ["train.tokens=2e6", "train.seed=7", "train.lr=3e-4", "output.dir=/x",
                             "model.path=/y", "train.compile=true", "data.add_bos=yes"])
    assert cfg.train.tokens == 2_000_000 and isinstance(cfg.train.tokens, int)
    assert (cfg.train.seed, cfg.train.lr, cfg.output.dir, cfg.model.path) == (7, 3e-4, "/x", "/y")
    assert cfg.train.compile is True and cfg.data.add_bos is True


def test_overrides_do_not_mutate_input():
    apply_overrides(BASE, ["train.tokens=5"])
    assert BASE["train"]["tokens"] == 1000


@pytest.mark.parametrize("override, key", [
    ("train.tokenz=5", "train.tokenz"),
    ("nosuch.key=1", "nosuch"),
    ("train.lr=-1", "train.lr"),
    ("train.precision=fp8", "train.precision"),
    ("train.seq_len=abc", "train.seq_len"),
    ("teacher.kl_weight=0.5", "teacher.path"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(GqakitError) as e:
        load_config(BASE, [override])
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_budget_alpha_times_pretrain_tokens():
    tree = {**BASE, "train": {"alpha": 0.05, "pretrain_tokens": 1_000_000}}
    assert load_config(tree).train.budget() == 50_000
    with pytest.raises(GqakitError, match="train.pretrain_tokens"):
        load_config({**BASE, "train": {"alpha": 0.05}})


def test_exactly_one_data_source():
    with pytest.raises(GqakitError, match="data"):
        load_config(BASE, ["data.files=[x.txt]"])
    with pytest.raises(GqakitError, match="data"):
        load_config({**BASE, "data": {}})


def test_override_syntax_errors():
    with pytest.raises(GqakitError, match="section.key=value"):
        load_config(BASE, ["train.tokens"])
    with pytest.raises(GqakitError, match="not a section"):
        load_config(BASE, ["train.tokens.x=1"])


def test_yaml_file_missing_and_invalid(tmp_path: Path):
    with pytest.raises(GqakitError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(GqakitError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("text, where", [
    ("model:\n  path: a\n   bad: 1\n", "line 3, column 7: mapping values are not allowed here"),
    ("model: [unclosed\n", "line 2, column 1: expected ',' or ']', but got '<stream end>' "
                           "(while parsing a flow sequence that starts at line 1, column 8)"),
    ("train:\n  lr: 'open\n", "(while scanning a quoted scalar that starts at line 2, column 7)"),
])
def test_yaml_syntax_errors_give_line_and_column(tmp_path: Path, text: str, where: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(GqakitError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"{bad} is not valid YAML: line ") and where in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
    ("train.warmup_step=1", "unknown config key 'train.warmup_step'; did you mean 'train.warmup_steps'?"),
    ("trian.lr=1", "unknown config key 'trian'; did you mean 'train'?"),
    ("teacher.kl_wieght=1", "unknown config key 'teacher.kl_wieght'; did you mean 'teacher.kl_weight'?"),
    ("train.lora.alhpa=4", "unknown config key 'train.lora.alhpa'; did you mean 'train.lora.alpha'?"),
    ("train.zzzzzz=1", "unknown config key 'train.zzzzzz'"),
])
def test_unknown_keys_suggest_the_closest_field_of_their_section(override: str, message: str):
    tree = {**BASE, "train": {**BASE["train"], "lora": {}}} if ".lora." in override else BASE
    with pytest.raises(GqakitError) as e:
        load_config(tree, [override])
    assert str(e.value) == message


def test_an_unknown_key_is_named_before_the_required_one_it_misspells():
    tree = {k: v for k, v in BASE.items() if k != "model"}
    with pytest.raises(GqakitError) as e:
        load_config(tree, ["model.pth=/m"])
    assert str(e.value) == "unknown config key 'model.pth'; did you mean 'model.path'?"
    with pytest.raises(GqakitError) as e:
        load_config({"train": {"tokens": 5}}, ["teacher.kl_weight=1"])
    assert str(e.value) == ("missing required settings: model.path, teacher.path, data.files, output.dir "
                            "(give them as key=value overrides)")


def test_cli_unknown_key_is_one_line_exit_2(tmp_path: Path):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(cfg), "train.nope=1"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "gqakit: error: unknown config key 'train.nope'"
    # the config is valid, but model.path does not exist: a real run would not start
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(cfg), "train.seed=3", "--dry-run"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "seed: 3" in r.stdout
    assert r.stderr.strip() == "gqakit: error: model.path: /m is not a model folder (no config.json)"
