"""The Python API (docs/api.md): signatures generated from the CLI's settings, the same results as
the commands, a model converted in memory, `import gqakit` without torch, and the docs' examples."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gqakit
from gqakit.cli import main
from gqakit.core.errors import GqakitError
from tiny_models import build

REPO = Path(__file__).resolve().parents[1]
TEXT = " ".join(f"w{i % 13} x{i % 7}y z" for i in range(120))


def cli(args: list[str], capsys) -> tuple[int, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def mha(tmp_path_factory) -> Path:
    return build("llama", tmp_path_factory.mktemp("api") / "mha")


# ----------------------------------------------------------------------------- signatures


def test_convert_signature_is_the_settings_fields():
    from gqakit.convert import RUN_OPTIONS
    from gqakit.convert.cli import convert_cmd
    from gqakit.convert.settings import ConvertSettings

    sig = inspect.signature(gqakit.convert)
    assert sig == inspect.signature(gqakit.convert.convert) == inspect.signature(gqakit.convert.__call__)
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())
    fields = {n: f for n, f in ConvertSettings.model_fields.items() if n not in ("source", "source_hub")}  # the source, and the Hub id it resolved to
    assert list(sig.parameters) == ["src", "out", *fields, *RUN_OPTIONS]
    for name, f in fields.items():
        p = sig.parameters[name]
        assert p.kind is p.KEYWORD_ONLY
        if name != "refit":  # a dict of options is taken too; the field's default is built by a factory
            assert p.annotation == f.annotation, name
            assert p.default == (p.empty if f.is_required() else f.default), name
    # every option of the command is an argument (--refit-option KEY=VALUE is `refit`)
    flags = {{"refit_options": "refit"}.get(p.name, p.name) for p in convert_cmd.params}
    assert flags == set(sig.parameters), flags ^ set(sig.parameters)
    assert "Example" in gqakit.convert.__call__.__doc__


def test_uptrain_signature_is_the_config_sections():
    from gqakit.uptrain import RUN_OPTIONS
    from gqakit.uptrain.cli import uptrain_cmd
    from gqakit.uptrain.config import UptrainConfig

    sig = inspect.signature(gqakit.uptrain)
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())
    assert list(sig.parameters) == ["config", "overrides", *UptrainConfig.model_fields, *RUN_OPTIONS]
    # the command's options, but the memory plan of --dry-run (printed, not returned) and the
    # listing of shipped configs (gqakit.uptrain.config.packaged_configs() in Python)
    assert {p.name for p in uptrain_cmd.params} - {"device_memory", "accelerate_config", "list_configs"} \
        == {"config", "overrides", *RUN_OPTIONS}
    assert "Example" in gqakit.uptrain.__call__.__doc__


def test_evaluate_signature_is_the_eval_options():
    from gqakit.eval.cli import eval_cmd

    sig = inspect.signature(gqakit.evaluate)
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())
    names = [{"compile_": "compile"}.get(p.name, p.name) for p in eval_cmd.params]
    assert list(sig.parameters) == ["model", "text", *names[1:]]
    ctx = __import__("click").Context(eval_cmd)
    for p in eval_cmd.params[1:]:
        default = p.get_default(ctx)
        if p.name not in ("out", "data", "tasks"):  # --out is required on the command line; the others have none
            assert sig.parameters[{"compile_": "compile"}.get(p.name, p.name)].default == default, p.name
    assert sig.parameters["context"].annotation is int and sig.parameters["speed"].annotation is bool


def test_import_gqakit_needs_no_torch():
    """With torch unimportable: `import gqakit`, the version, the callables and their signatures."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import inspect, gqakit\n"
            "print(gqakit.__version__)\n"
            "for f in (gqakit.convert, gqakit.uptrain, gqakit.evaluate, gqakit.convert_model):\n"
            "    assert callable(f); inspect.signature(f)\n"
            "assert 'num_kv_heads' in inspect.signature(gqakit.convert).parameters\n"
            "import importlib; importlib.import_module('gqakit.convert.cli')\n"
            "assert callable(gqakit.convert)  # still the callable package after a submodule import\n"
            "try:\n"
            "    gqakit.convert_model(object(), 2)\n"
            "except ImportError:\n"
            "    print('torch needed when called')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [gqakit.__version__, "torch needed when called"]


# ----------------------------------------------------------------------------- convert


def test_convert_api_writes_what_the_cli_writes(mha, tmp_path, capsys):
    code, err = cli(["convert", str(mha), str(tmp_path / "cli"), "-g", "2", "--method", "mean", "-q"], capsys)
    assert code == 0, err
    out = gqakit.convert(mha, tmp_path / "api", num_kv_heads=2, method="mean", quiet=True)
    assert out == (tmp_path / "api").resolve()
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    settings = [json.loads((tmp_path / d / "gqakit_convert.json").read_text())["settings"] for d in ("cli", "api")]
    assert settings[0] == settings[1]


def test_convert_api_errors_are_the_cli_lines(mha, tmp_path, capsys):
    code, err = cli(["convert", str(mha), str(tmp_path / "c"), "-g", "3"], capsys)
    assert code == 2
    with pytest.raises(GqakitError) as e:
        gqakit.convert(mha, tmp_path / "a", num_kv_heads=3)
    assert err.strip() == f"gqakit: error: {e.value}"
    with pytest.raises(GqakitError, match="unknown align-refit option"):
        gqakit.convert(mha, tmp_path / "a", num_kv_heads=2, method="align-refit", refit={"stepz": 1})
    with pytest.raises(TypeError):
        gqakit.convert(mha, tmp_path / "a", num_kv_heads=2, metod="mean")
    with pytest.raises(GqakitError, match="give -g G"):
        gqakit.convert(mha, tmp_path / "a")  # num_kv_heads, kv_budget or kv_plan is required
    # an option given that does not apply is refused, as on the command line; its default is not
    with pytest.raises(GqakitError, match="--max-shard-size applies to a model folder"):
        gqakit.convert(mha, tmp_path / "a.gguf", num_kv_heads=2, max_shard_size="2GB")
    with pytest.raises(GqakitError, match="a .gguf OUT needs a .gguf SRC"):
        gqakit.convert(mha, tmp_path / "a.gguf", num_kv_heads=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    assert not (tmp_path / "a.gguf").exists()


# ----------------------------------------------------------------------------- convert_model


def test_convert_model_at_g_equal_h_is_the_model(mha):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mha)
    same = gqakit.convert_model(model, num_kv_heads=8, force=True)  # G = H: a copy, asked for
    assert same is not model and same.config.num_key_value_heads == 8
    for (n, a), (_, b) in zip(model.state_dict().items(), same.state_dict().items()):
        assert torch.equal(a, b), n  # groups of one head: the mean of one head is that head, bit for bit
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same fp32 weights through the same kernels: equal, bit for bit (no tolerance is due)
        assert torch.equal(model(ids).logits, same(ids).logits)


@pytest.mark.parametrize("method", ["mean", "align"])
def test_convert_model_equals_the_folder_conversion(mha, tmp_path, method):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mha)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g2 = gqakit.convert_model(model, num_kv_heads=2, method=method)
    disk = AutoModelForCausalLM.from_pretrained(gqakit.convert(mha, tmp_path / "g2", num_kv_heads=2, method=method,
                                                               quiet=True))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original is untouched
    for (n, a), (_, b) in zip(disk.state_dict().items(), g2.state_dict().items()):
        assert torch.equal(a, b), n
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = g2(ids, use_cache=True)
        assert torch.equal(out.logits, disk(ids).logits)  # equal weights, same class and kernels: bit for bit
    keys = out.past_key_values.layers[0].keys
    assert keys.shape[1] == 2 == g2.config.num_key_value_heads  # the cache holds G heads


def test_convert_model_refuses_what_it_cannot_do(mha, tmp_path):
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_pretrained(build("gpt2", tmp_path / "gpt2"))
    with pytest.raises(GqakitError, match="gpt2 class has no grouped-query attention.*gqakit.convert"):
        gqakit.convert_model(gpt2, num_kv_heads=2)
    llama = AutoModelForCausalLM.from_pretrained(mha)
    with pytest.raises(GqakitError, match="align-refit calibrates.*gqakit.convert"):
        gqakit.convert_model(llama, num_kv_heads=2, method="align-refit")
    with pytest.raises(GqakitError, match="does not divide"):
        gqakit.convert_model(llama, num_kv_heads=3)
    with pytest.raises(GqakitError, match="takes a transformers model"):
        gqakit.convert_model("llama-mha", num_kv_heads=2)


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_text_equals_the_cli(mha, tmp_path, capsys):
    (tmp_path / "d.txt").write_text(TEXT)
    code, err = cli(["eval", str(mha), "--data", str(tmp_path / "d.txt"), "--context", "32", "--stride", "16",
                     "--out", str(tmp_path / "cli.json"), "-q"], capsys)
    assert code == 0, err
    want = json.loads((tmp_path / "cli.json").read_text())["perplexity"]
    res = gqakit.evaluate(mha, text=TEXT, context=32, stride=16, quiet=True)
    # the same text, windows and model on the same machine: the same sum, so the same number
    assert res.perplexity.token_perplexity == want["token_perplexity"]
    assert res.perplexity.data["sha256"] == want["data"]["sha256"]  # a file's bytes and the string's agree
    assert res.perplexity.data["path"] == "<text>"
    by_file = gqakit.evaluate(mha, data=tmp_path / "d.txt", context=32, stride=16, out=tmp_path / "api.json",
                              quiet=True)
    assert by_file.perplexity.token_perplexity == want["token_perplexity"]
    assert json.loads((tmp_path / "api.json").read_text())["perplexity"]["token_perplexity"] \
        == want["token_perplexity"]
    with pytest.raises(GqakitError, match="exists"):  # the output rule: no overwrite without overwrite=True
        gqakit.evaluate(mha, text=TEXT, context=32, out=tmp_path / "api.json")
    with pytest.raises(GqakitError, match="not both"):
        gqakit.evaluate(mha, text=TEXT, data=tmp_path / "d.txt")
    with pytest.raises(GqakitError, match="--stride must be"):
        gqakit.evaluate(mha, text=TEXT, context=32, stride=64)


# ----------------------------------------------------------------------------- uptrain


def test_uptrain_overrides_reach_the_config_as_the_cli_reads_them(mha, tmp_path):
    from gqakit.uptrain import override_item
    from gqakit.uptrain.config import apply_overrides

    values = {"model.path": "a path: with colon", "data.files": ["x.txt", "y.txt"], "train.lr": 3e-4,
              "train.tokens": 2048, "train.cpu": True, "teacher.path": None, "output.dir": "yes",
              "data.eval_file": Path("v.txt")}
    tree = apply_overrides({}, [override_item(k, v) for k, v in values.items()])
    for key, v in values.items():
        section, name = key.split(".")
        assert tree[section][name] == (str(v) if isinstance(v, Path) else v), key


def test_uptrain_dry_run_checks_and_writes_nothing(mha, tmp_path):
    g2 = gqakit.convert(mha, tmp_path / "g2", num_kv_heads=2, method="mean", quiet=True)
    cfg = {"model": {"path": str(g2)}, "data": {"texts": [TEXT] * 4}, "train": {"tokens": 4096, "seq_len": 32},
           "output": {"dir": str(tmp_path / "run")}}
    checked = gqakit.uptrain(cfg, {"train.tokens": 1024}, train={"micro_batch": 2}, dry_run=True)
    assert checked.train.tokens == 1024 and checked.train.micro_batch == 2
    assert not (tmp_path / "run").exists()
    with pytest.raises(GqakitError, match="unknown config key"):
        gqakit.uptrain(cfg, {"train.tokenz": 1}, dry_run=True)


# ----------------------------------------------------------------------------- docs/api.md


def test_docs_api_examples_run(tmp_path, monkeypatch, capsys):
    """Every python block of docs/api.md, in order, in a folder holding what the page says."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) >= 4
    build("llama", tmp_path / "llama-mha")
    (tmp_path / "train.txt").write_text("\n".join(TEXT[i:] + TEXT[:i] for i in range(0, 400, 40)))
    (tmp_path / "valid.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs/api.md", "exec"), {})
    assert (tmp_path / "run-g2" / "model" / "config.json").is_file()
    assert json.loads((tmp_path / "g2.json").read_text())["perplexity"]["token_perplexity"] > 1
