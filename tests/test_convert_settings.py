"""The conversion settings: one typed model, and the CLI, --help and docs/convert.md that come from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from gqakit.convert.refit_options import RefitOptions, refit_options_markdown
from gqakit.convert.resolved import ResolvedSettings, resolve_settings
from gqakit.convert.settings import ConvertSettings
from gqakit.core.errors import GqakitError

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "convert.md"  # the conversion reference


def test_readme_table_of_refit_options_is_the_models():
    text = GUIDE.read_text()
    table = refit_options_markdown()
    assert table in text, ("docs/convert.md's align-refit option table differs from convert/refit_options.py; paste "
                           "gqakit.convert.refit_options.refit_options_markdown() into it")
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


# ----------------------------------------------------------------------------- the automatic defaults

def _readme_section(heading: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"## {heading}\n")
    return text[start:text.index("\n## ", start + 1)]


def test_auto_settings_follow_the_models_size_and_context():
    s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit")
    small = resolve_settings(s, source_params=300_000, max_positions=256)
    assert (small.grouping, small.options.seq_len, small.options.steps, small.options.lr, small.options.train,
            small.options.loss) == ("similarity", 256, 900, 0.024, "block", "block")
    large = resolve_settings(s, source_params=135_000_000, max_positions=8192)
    assert (large.grouping, large.options.seq_len, large.options.steps, large.options.lr, large.options.train,
            large.options.loss) == ("contiguous", 512, 400, 0.02, "attention", "attention")
    reasons = large.auto_reasons()
    assert set(reasons) == {"grouping", "seq_len", "steps", "lr", "train", "loss", "batch", "dtype", "step_dtype",
                            "stream_dtype", "offload"}
    assert all(r.startswith("auto: ") for r in reasons.values()) and "135M parameters" in reasons["steps"]
    assert s.refit.steps == "auto"  # the settings asked for are untouched
    # resolved means typed: no field of the resolved options accepts "auto" any more
    assert isinstance(large, ResolvedSettings) and large.output == "folder" and large.max_shard_bytes == 2 * 10**9
    chosen = {k: getattr(large.options, k) for k in ("seq_len", "steps", "lr", "train", "loss", "batch", "dtype",
                                                     "step_dtype", "stream_dtype", "offload")}
    for key in chosen:
        with pytest.raises(ValidationError):
            type(large.options)(**{**chosen, key: "auto"})
    # fewer calibration tokens, fewer steps; a GGUF OUT never trains whole blocks; --effort fast: no steps
    few = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", calibration_tokens=2048)
    assert resolve_settings(few, source_params=135_000_000, max_positions=None).options.steps == 12
    gguf = resolve_settings(s, source_params=300_000, max_positions=256, output="gguf")
    assert gguf.options.train == "attention" and gguf.output == "gguf" and gguf.max_shard_bytes is None
    assert gguf.record()["max_shard_size"] == "-"  # the output kind says it, not a missing shard size
    fast = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", effort="fast")
    assert resolve_settings(fast, source_params=300_000, max_positions=256).options.steps == 0
    assert "--effort fast" in resolve_settings(fast, source_params=300_000, max_positions=256).auto_reasons()["steps"]
    # other methods keep the paper's grouping and record nothing automatic
    mean = resolve_settings(ConvertSettings(source="m", num_kv_heads=1, method="mean"), source_params=1000,
                            max_positions=64)
    assert mean.grouping == "contiguous" and mean.auto_reasons() == {} and "auto" not in mean.record()


def test_the_steps_loss_follows_what_they_train():
    """The attention loss trains q, k, v and o only: asked for, it makes train auto resolve to
    attention; train=block (asked for, or auto on a small model), or fewer calibration tokens than
    the steps are set for, makes loss auto the block loss; lr auto follows the loss."""
    def resolve(params, tokens=65536, **refit):
        s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", calibration_tokens=tokens, refit=refit)
        o = resolve_settings(s, source_params=params, max_positions=256).options
        return o.train, o.loss, o.lr

    assert resolve(300_000) == ("block", "block", 0.024)
    assert resolve(300_000, loss="attention") == ("attention", "attention", 0.024)
    assert resolve(135_000_000) == ("attention", "attention", 0.02)
    assert resolve(135_000_000, train="block") == ("block", "block", 0.01)
    assert resolve(135_000_000, loss="block") == ("attention", "block", 0.01)
    # fewer calibration tokens, fewer steps: the block loss (the demo's 2,048 tokens take 12 steps)
    assert resolve(135_000_000, tokens=2048) == ("attention", "block", 0.01)
    assert resolve(135_000_000, tokens=2048, loss="attention") == ("attention", "attention", 0.02)


def test_explicit_settings_win_over_auto():
    s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", grouping="contiguous", effort="fast",
                        refit={"steps": 7, "lr": 0.02, "train": "attention", "loss": "block", "seq_len": 64,
                               "batch": 3, "dtype": "float32", "step_dtype": "float32", "stream_dtype": "bfloat16",
                               "offload": "disk"})
    r = resolve_settings(s, source_params=300_000, max_positions=256)
    assert (r.grouping, r.options.seq_len, r.options.steps, r.options.lr, r.options.train) == \
        ("contiguous", 64, 7, 0.02, "attention")
    assert r.auto_reasons() == {} and r.record()["options"] == {"steps": 7, "lr": 0.02, "train": "attention",
                                                                "loss": "block", "seq_len": 64, "batch": 3,
                                                                "dtype": "float32", "step_dtype": "float32",
                                                                "stream_dtype": "bfloat16",
                                                                "offload": "disk"}


def test_auto_settings_are_recorded_and_the_expected_time_is_shown(tiny_model, tmp_path, capsys):
    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4)
    args = ["convert", str(src), "OUT", "-g", "2", "--method", "align-refit", "--device", "cpu",
            "--calibration-tokens", "256", "--refit-option", "steps=3"]
    main([a if a != "OUT" else str(tmp_path / "out") for a in args])
    err = capsys.readouterr().err
    assert re.search(r"expected time: about \d+ s in all, \d+ s left \(\d+ s per layer, measured on the first; "
                     r"1 of 2 layers to go\)", err), err
    rec = json.loads((tmp_path / "out" / "gqakit_convert.json").read_text())["settings"]
    assert rec["options"]["steps"] == 3 and "steps" not in rec["auto"]  # given: kept, no reason
    assert rec["grouping"] == "similarity" and rec["options"]["seq_len"] == 128 and rec["options"]["lr"] == 0.024
    assert rec["options"]["train"] == "block" and rec["effort"] == "best"
    assert set(rec["auto"]) == {"grouping", "seq_len", "lr", "train", "loss", "batch", "dtype", "step_dtype",
                                "stream_dtype", "offload"}
    assert rec["auto"]["seq_len"] == "auto: 128 (the model's context 128, at most 512)"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "chosen for this model" in card and "auto: similarity" in card
    # -q: nothing on stderr, the expected time included
    main([a if a != "OUT" else str(tmp_path / "quiet") for a in args] + ["-q"])
    assert capsys.readouterr().err == ""


def test_readme_recommended_command_is_the_defaults(tmp_path):
    """docs/convert.md's "Conversion methods" recommends a command that sets nothing but the method and the
    data: what it runs is what the defaults do, and the table of what they resolve to is the code's."""
    import shlex

    from gqakit.convert.cli import convert_cmd
    from gqakit.convert.refit_options import BEST, auto_settings_markdown

    section = _readme_section("Conversion methods")
    assert auto_settings_markdown() in section, ("docs/convert.md's table of align-refit's automatic settings differs "
                                                 "from convert/refit_options.py: paste auto_settings_markdown() into it")
    cmd = re.search(r"```bash\n(gqakit convert [^\n]*--method align-refit[^\n]*)\n```", section).group(1)
    args = [a if a != "G" else "1" for a in shlex.split(cmd)[2:]]  # -g G: the user's number
    ctx = convert_cmd.make_context("convert", args)
    params = {k: v for k, v in ctx.params.items() if k in ConvertSettings.model_fields}
    asked = {k for k, v in params.items() if v != ConvertSettings.model_fields[k].default}
    assert asked == {"num_kv_heads", "method", "calibration_data"} and ctx.params["refit_options"] == ()
    data = tmp_path / "in-domain.txt"
    data.write_text("text")
    readme = ConvertSettings(source="m", **{**params, "num_kv_heads": 1, "calibration_data": str(data)})
    default = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", calibration_data=str(data))
    for params_count, size in ((135_000_000, "large"), (300_000, "small")):
        got = resolve_settings(readme, source_params=params_count, max_positions=2048)
        assert got.record() == resolve_settings(default, source_params=params_count, max_positions=2048).record()
        assert (got.options.steps, got.options.lr, got.options.train, got.grouping) == \
            tuple(BEST[size][k] for k in ("steps", "lr", "train", "grouping"))
