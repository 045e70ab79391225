"""The conversion settings: one typed model, and the CLI, --help and README that come from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gqakit.convert.settings import ConvertSettings, RefitOptions, refit_options_markdown
from gqakit.core.errors import GqakitError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_of_refit_options_is_the_models():
    text = README.read_text()
    table = refit_options_markdown()
    assert table in text, ("README.md's align-refit option table differs from convert/settings.py; paste "
                           "gqakit.convert.settings.refit_options_markdown() into it")
    keys = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert keys == list(RefitOptions.model_fields)
    assert {"steps", "lr", "guard_spans", "train", "sample_batch"} <= set(keys)


def test_help_lists_every_refit_option_with_its_default():
    from click.testing import CliRunner

    from gqakit.convert.cli import convert_cmd

    out = " ".join(CliRunner().invoke(convert_cmd, ["--help"]).output.split())
    for key, field in RefitOptions.model_fields.items():
        assert f"{key}={field.default}: {field.description}" in out
    # the flags come from the model too: each field's default is the flag's
    params = {p.name: p for p in convert_cmd.params}
    for name, field in ConvertSettings.model_fields.items():
        if name in params and not params[name].required:
            assert params[name].default == field.default, name


@pytest.mark.parametrize("size", ["0", "0MB", "-1GB", "nonsense"])
def test_max_shard_size_must_be_positive(tiny_model, tmp_path, capsys, size):
    from gqakit.cli import main

    src = tiny_model("llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "out"), "-g", "2", "--max-shard-size", size, "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and ("more than 0 bytes" in err[0] or "invalid size" in err[0]), err
    assert not list(tmp_path.glob("*out*"))


def test_options_are_recorded_as_given_and_resolved_in_one_order():
    s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit",
                        refit={"steps": 4, "seq_len": 32, "q_ridge": 1})
    assert list(s.record()["options"].items()) == [("steps", 4), ("seq_len", 32), ("q_ridge", 1)]
    assert list(s.refit.model_dump()) == list(RefitOptions.model_fields) and s.refit.q_ridge == 1
    assert s.record()["max_shard_size"] == "2GB"
    assert ConvertSettings(source="m", num_kv_heads=1, max_shard_size=None).record()["max_shard_size"] == "-"
    with pytest.raises(GqakitError, match="method mean takes no options"):
        ConvertSettings(source="m", num_kv_heads=1, method="mean", refit={"seq_len": 32})
    with pytest.raises(Exception):  # frozen: what was validated cannot change underneath
        s.refit.steps = 5  # type: ignore[misc]
