"""Hostile model files on every verb that reads a model: one line naming the file and the
field, exit code 2, no traceback, no hang, and nothing changed.

Each case breaks one file of a copy of the hostile battery's world (`test_hostile.py`):
a config.json whose geometry the weights contradict, layers missing or added, a
model_type from another family, an index that reaches outside the model folder, a
pickle that would run code, GGUF metadata that lies, a record whose glob would walk the
whole disk, and a source truncated while `align-refit` reads it. The checks behind them
live in `core/modelfiles.py` and `core/globs.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from test_hostile import assets, refused, run_cli, snapshot, world, write_cfg  # noqa: F401 (fixtures)

from gqakit.core.globs import bounded_glob


def verbs(world: Path, assets: Path, model: Path) -> list[list]:
    """inspect, convert, eval and uptrain of MODEL (uptrain's config is written first)."""
    cfg = write_cfg(world, assets, out=world / "new")
    return [["inspect", model],
            ["convert", model, world / "out", "-g", 1, "-q"],
            ["eval", model, "--data", world / "data" / "eval.txt", "--context", 16, "--out", world / "r.json", "-q"],
            ["uptrain", cfg, f"model.path={model}", "-q"]]


def edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (model / "config.json").write_text(json.dumps(cfg))


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """A hang becomes a TimeoutError (which the CLI reports as an internal error: the test fails)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def every_verb_refuses(world: Path, assets: Path, model: Path, capfd, *needles: str) -> None:
    for args in verbs(world, assets, model):
        with deadline(120):
            refused(world, args, capfd, *needles)


# ============================================================================ config.json against the weights


def test_absurd_head_count(world, assets, capfd):
    """10^12 heads: one line at once (convert and eval said "internal error", inspect hung)."""
    edit_config(world / "g2", num_attention_heads=10**12)
    every_verb_refuses(world, assets, world / "g2", capfd, "config.json", "num_attention_heads=1000000000000",
                       "q_proj.weight", "model.safetensors")


@pytest.mark.parametrize("change, needle", [
    ({"head_dim": 8}, "head_dim=8"),
    ({"num_attention_heads": 4}, "num_attention_heads=4"),
    ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
])
def test_geometry_the_weights_contradict(world, assets, capfd, change, needle):
    """convert crashed or wrote an unloadable output, inspect printed the config's word,
    eval's message named no tensor: now each names the field, the tensor and the file."""
    edit_config(world / "g2", **change)
    every_verb_refuses(world, assets, world / "g2", capfd, "config.json", needle, "self_attn.", "model.safetensors",
                       "disagree with the weights")


def test_more_layers_in_the_config_than_in_the_weights(world, assets, capfd):
    """eval reported a perplexity with a layer of random weights."""
    edit_config(world / "g2", num_hidden_layers=3)
    every_verb_refuses(world, assets, world / "g2", capfd, "config.json", "num_hidden_layers=3", "model.layers.2.",
                       "not present in model.safetensors")


def test_fewer_layers_in_the_config_than_in_the_weights(world, assets, capfd):
    edit_config(world / "g2", num_hidden_layers=1)
    every_verb_refuses(world, assets, world / "g2", capfd, "config.json", "num_hidden_layers=1", "model.layers.1.",
                       "model.safetensors")


@pytest.mark.parametrize("drop, add", [("model.layers.1.mlp.up_proj.weight", None),
                                       (None, "model.layers.0.mlp.extra.weight")])
def test_a_layer_lacking_or_adding_a_weight(world, assets, capfd, drop, add):
    from safetensors.torch import load_file, save_file

    f = world / "g2" / "model.safetensors"
    sd = load_file(f)
    if drop:
        del sd[drop]
    if add:
        sd[add] = sd["model.layers.0.mlp.up_proj.weight"].clone()
    save_file(sd, f, metadata={"format": "pt"})
    every_verb_refuses(world, assets, world / "g2", capfd, "model.safetensors", "mlp.up_proj" if drop else "mlp.extra")


def test_model_type_of_another_family(world, assets, capfd):
    """model_type: bert on Llama weights: eval reported an untrained model's perplexity."""
    edit_config(world / "g2", model_type="bert")
    every_verb_refuses(world, assets, world / "g2", capfd, "config.json", "model_type 'bert'", "LlamaForCausalLM")


def test_eval_of_a_family_gqakit_does_not_know_loads_every_weight_or_refuses(world, capfd):
    """Without `architectures`, `bert` is no family of gqakit's: eval still refuses a model
    that would run with weights the files do not hold."""
    edit_config(world / "g2", model_type="bert", architectures=None)
    refused(world, ["eval", world / "g2", "--data", world / "data" / "eval.txt", "--context", 16,
                    "--out", world / "r.json", "-q"], capfd, str(world / "g2"), "the weights lack", "BertLMHeadModel")
    refused(world, ["inspect", world / "g2"], capfd, "unsupported architecture 'bert'")


# ============================================================================ a model folder is read only inside itself


@pytest.mark.parametrize("where", ["../elsewhere.safetensors", "ABSOLUTE"])
def test_index_naming_a_file_outside_the_model_folder(world, assets, capfd, where):
    """eval loaded a valid safetensors file from outside the folder; every verb refuses now."""
    from safetensors.torch import load_file

    g2 = world / "g2"
    outside = world / "elsewhere.safetensors"
    shutil.move(g2 / "model.safetensors", outside)
    rel = str(outside) if where == "ABSOLUTE" else where
    (g2 / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: rel for name in load_file(outside)}}))
    every_verb_refuses(world, assets, g2, capfd, "model.safetensors.index.json", repr(rel), "escapes",
                       "read only inside itself")


class _Planted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code(world, assets, capfd, tmp_path):
    """eval and uptrain printed "internal error" with torch's UnpicklingError; no code ran."""
    import torch
    from safetensors.torch import load_file

    g2 = world / "g2"
    marker = tmp_path / "planted-code-ran"
    sd = load_file(g2 / "model.safetensors")
    sd["planted"] = _Planted(marker)
    torch.save(sd, g2 / "pytorch_model.bin")
    (g2 / "model.safetensors").unlink()
    every_verb_refuses(world, assets, g2, capfd, "pytorch_model.bin", "needs unsafe unpickling")
    assert not marker.exists(), "the planted pickle ran"


# ============================================================================ GGUF metadata that lies


def patched_gguf(src: Path, dst: Path, key: str, value: int) -> Path:
    """A copy of SRC with the uint32 metadata KEY set to VALUE (same size, same tensors)."""
    raw = bytearray(src.read_bytes())
    k = key.encode()
    at = raw.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack_from("<I", raw, at)[0] == 4, "not a uint32 field"
    struct.pack_into("<I", raw, at + 4, value)
    dst.write_bytes(bytes(raw))
    return dst


@pytest.fixture(scope="module")
def gguf_file(assets) -> Path:
    from test_convert_gguf import write_gguf
    from transformers import AutoModelForCausalLM

    return write_gguf(AutoModelForCausalLM.from_pretrained(assets / "mha"), assets.parent / "mha.gguf")


@pytest.mark.parametrize("key, value, needles", [
    ("llama.attention.head_count_kv", 0, ("llama.attention.head_count_kv must be a positive integer, got 0",)),
    ("llama.block_count", 1000, ("llama.block_count is 1000", "2 blocks")),
    ("llama.context_length", 0, ("llama.context_length must be a positive integer, got 0",)),
    ("llama.attention.head_count", 16, ("head_count=16", "blk.0.attn_k.weight")),
    ("llama.attention.head_count", 4, ("head_count 4 is not a multiple of", "head_count_kv 8")),
])
def test_gguf_metadata_that_lies(world, gguf_file, capfd, key, value, needles):
    """ZeroDivisionError (head_count_kv 0), a hang (block_count 1000), accepted nonsense
    (context_length 0, a head_count the tensors contradict): one line each."""
    bad = patched_gguf(gguf_file, world / "bad.gguf", key, value)
    for args in (["inspect", bad],
                 ["convert", bad, world / "out", "-g", 1, "-q"],
                 ["eval", bad, "--data", world / "data" / "eval.txt", "--context", 16, "--out", world / "r.json", "-q"]):
        with deadline(120):
            refused(world, args, capfd, "bad.gguf", *needles)


def test_gguf_that_tells_the_truth_still_converts(world, gguf_file, capfd):
    """The other half: the checks pass an honest GGUF."""
    good = world / "good.gguf"
    shutil.copy(gguf_file, good)
    code, out, err = run_cli(["inspect", good], capfd)
    assert code == 0 and "query heads 8" in out, err


# ============================================================================ records of a model folder


def test_seen_in_training_check_never_walks_the_whole_disk(world, capfd, monkeypatch):
    """A model folder's gqakit_uptrain.yaml that lists `/**/...`: eval answers promptly,
    without handing the pattern to an unbounded glob."""
    import glob

    model = world / "run" / "model"
    settings = yaml.safe_load((model / "gqakit_uptrain.yaml").read_text())
    settings["settings"]["data"]["files"] = ["/**/*.txt", "/**/train.txt"]
    (model / "gqakit_uptrain.yaml").write_text(yaml.safe_dump(settings))
    real = glob.glob

    def no_root_walk(pattern, *a, **kw):
        assert not str(pattern).startswith("/**"), f"unbounded glob of {pattern}"
        return real(pattern, *a, **kw)

    monkeypatch.setattr(glob, "glob", no_root_walk)
    monkeypatch.setattr(glob, "iglob", no_root_walk)
    t0 = time.monotonic()
    code, _, err = run_cli(["eval", model, "--data", world / "data" / "eval.txt", "--context", 16,
                            "--out", world / "r.json", "-q"], capfd)
    assert code == 0 and err == "", err
    assert time.monotonic() - t0 < 60


def test_bounded_glob_stops_at_its_budget(tmp_path):
    for i in range(30):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "a.txt").write_text("x")
    files, done = bounded_glob(str(tmp_path / "**" / "*.txt"), max_entries=100)
    assert done and len(files) == 30
    files, done = bounded_glob(str(tmp_path / "**" / "*.txt"), max_entries=20)
    assert not done and len(files) < 30
    assert bounded_glob(str(tmp_path / "d3" / "a.txt"), max_entries=0) == ([str(tmp_path / "d3" / "a.txt")], True)


# ============================================================================ a source truncated mid-run

TRUNCATE = r"""
import os, sys
from pathlib import Path
from gqakit.cli import main
from gqakit.convert import io

source = Path(sys.argv[1])
real = io.ShardWriter.write

def write_then_truncate(self, name, tensor):
    real(self, name, tensor)
    if not getattr(io, "_cut", False):  # after the first converted layer: the source loses its second half
        io._cut = True
        os.truncate(source, source.stat().st_size // 2)

io.ShardWriter.write = write_then_truncate
try:
    main(sys.argv[2:])
except SystemExit as e:
    sys.exit(e.code)
"""


def test_source_truncated_while_align_refit_reads_it(world, tmp_path):
    """The process died by SIGBUS with no message: now one line naming the file, exit 2.
    (A separate process: a SIGBUS would otherwise end the test run itself.)"""
    src = world / "mha"
    before = snapshot(world)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", TRUNCATE, str(src / "model.safetensors"), "convert", str(src),
                        str(world / "out"), "-g", "2", "--method", "align-refit", "--calibration-data",
                        str(world / "data" / "train.txt"), "--calibration-tokens", "256", "--refit-option",
                        "seq_len=16", "--refit-option", "save_seconds=100000", "-q"],
                       capture_output=True, text=True, env=env, timeout=280)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gqakit: error: "), r.stderr
    assert "model.safetensors" in lines[0] and "truncated" in lines[0], lines[0]
    after = snapshot(world)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == ["mha/model.safetensors"], changed  # only the file the test cut; no output left

