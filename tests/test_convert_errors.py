"""Bad input to `gqakit convert`: one line on stderr, exit 2, SRC untouched, no OUT left."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gqakit.cli import main


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit code, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().err


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("converting", "Loading", "Writing"))]
    assert len(lines) == 1 and lines[0].startswith("gqakit: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def src(tiny_model) -> Path:
    return tiny_model("llama", num_key_value_heads=4)  # 8 query heads, 4 KV heads


@pytest.mark.parametrize("g, needle", [(3, "does not divide"), (0, "at least 1"), (8, "larger than"), (-1, "at least 1")])
def test_bad_g(src, tmp_path, capsys, g, needle):
    before = digest(src)
    code, err = run_cli(["convert", src, tmp_path / "out", "-g", g], capsys)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists() and digest(src) == before


def test_missing_and_empty_source(tmp_path, capsys):
    assert_one_line_error(*run_cli(["convert", tmp_path / "nope", tmp_path / "o", "-g", 1], capsys), "not found")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run_cli(["convert", tmp_path / "empty", tmp_path / "o", "-g", 1], capsys), "empty")


def test_missing_config_or_weights(src, tmp_path, capsys):
    no_cfg = tmp_path / "no-cfg"
    shutil.copytree(src, no_cfg)
    (no_cfg / "config.json").unlink()
    assert_one_line_error(*run_cli(["convert", no_cfg, tmp_path / "o", "-g", 2], capsys), "config.json")
    no_w = tmp_path / "no-w"
    shutil.copytree(src, no_w)
    (no_w / "model.safetensors").unlink()
    assert_one_line_error(*run_cli(["convert", no_w, tmp_path / "o", "-g", 2], capsys), "no weights")


def test_missing_tensor_is_named(src, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(*run_cli(["convert", bad, tmp_path / "o", "-g", 2], capsys),
                          "model.layers.1.self_attn.k_proj.weight", "model.safetensors")


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_safetensors(src, tmp_path, capsys, cut):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:6] if cut == "header" else data[: len(data) // 2])
    assert_one_line_error(*run_cli(["convert", bad, tmp_path / "o", "-g", 2], capsys), "truncated or corrupt")
    assert not (tmp_path / "o").exists()


def test_corrupt_safetensors_header(src, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"not json!!!!"
    f.write_bytes(bytes(data))
    assert_one_line_error(*run_cli(["convert", bad, tmp_path / "o", "-g", 2], capsys), "model.safetensors")


def _sharded(src: Path, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src).save_pretrained(dest, max_shard_size="20KB")
    shutil.copy(src / "config.json", dest / "config.json")
    return dest


def test_index_names_missing_shard(src, tmp_path, capsys):
    d = _sharded(src, tmp_path / "sh")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(*run_cli(["convert", d, tmp_path / "o", "-g", 2], capsys), shard.name, "missing")


def test_index_shard_path_escaping_source(src, tmp_path, capsys):
    d = _sharded(src, tmp_path / "sh")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(d / index["weight_map"][first], outside)
    index["weight_map"][first] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(*run_cli(["convert", d, tmp_path / "o", "-g", 2], capsys), "escapes")


def test_unsupported_architecture_lists_supported(src, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(["convert", bad, tmp_path / "o", "-g", 2], capsys),
                          "MambaForCausalLM", "llama", "gpt2", "core/architectures")


def test_out_exists_or_equals_or_inside_source(src, tmp_path, capsys):
    before = digest(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(*run_cli(["convert", src, out, "-g", 2], capsys), "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"
    assert_one_line_error(*run_cli(["convert", src, src, "-g", 2], capsys), "is the source")
    assert_one_line_error(*run_cli(["convert", src, src / "sub", "-g", 2], capsys), "inside")
    assert_one_line_error(*run_cli(["convert", src, src.parent, "-g", 2, "--overwrite"], capsys), "contains the source")
    assert digest(src) == before
    # --overwrite replaces only what gqakit wrote: a folder of the user's is refused, kept whole.
    assert_one_line_error(*run_cli(["convert", src, out, "-g", 2, "--overwrite", "-q"], capsys), "not written by gqakit")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    code, _ = run_cli(["convert", src, out, "-g", 2, "-q"], capsys)  # empty now: fine to fill
    assert code == 0 and (out / "model.safetensors").is_file()
    code, _ = run_cli(["convert", src, out, "-g", 1, "--overwrite", "-q"], capsys)  # gqakit's own: replaced
    assert code == 0 and json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_bin_needing_unsafe_unpickling_is_refused(src, tmp_path, capsys):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "evil": Evil()}, d / "pytorch_model.bin")
    assert_one_line_error(*run_cli(["convert", d, tmp_path / "o", "-g", 2], capsys), "unsafe unpickling")


@pytest.mark.parametrize("err, needle", [(errno.ENOSPC, "no space left"), (errno.EACCES, "permission denied")])
def test_write_errors_leave_nothing(src, tmp_path, capsys, monkeypatch, err, needle):
    from gqakit.convert import io as cio

    calls = {"n": 0}
    real = cio.ShardWriter._next  # every tensor write, decoded or raw, goes through it

    def failing(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(err, os.strerror(err), str(self.folder / "model.safetensors"))
        return real(self, name)

    monkeypatch.setattr(cio.ShardWriter, "_next", failing)
    before = digest(src)
    assert_one_line_error(*run_cli(["convert", src, tmp_path / "o", "-g", 2, "-q"], capsys), needle)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if ".gqakit-tmp-" in p.name]
    assert digest(src) == before


def test_real_permission_error_on_read_only_parent(src, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert_one_line_error(*run_cli(["convert", src, ro / "o", "-g", 2], capsys), "permission denied")
    finally:
        ro.chmod(0o700)


def test_sigkill_midway_leaves_no_output(tiny_model, tmp_path):
    """Kill the converter while it writes; OUT must not exist, SRC must be unchanged."""
    src = tiny_model("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=8, vocab_size=8192)
    before = digest(src)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "gqakit", "convert", str(src), str(out), "-g", "2",
                             "--max-shard-size", "1MB", "-q"], stderr=subprocess.PIPE)
    deadline = time.time() + 120
    killed = False
    while time.time() < deadline and proc.poll() is None:
        tmps = [p for p in tmp_path.iterdir() if ".gqakit-tmp-" in p.name]
        if tmps and len(list(tmps[0].glob("model-*.safetensors"))) >= 2:
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.005)
    proc.wait()
    assert killed, "conversion finished before it could be interrupted"
    assert not out.exists()
    assert digest(src) == before
    # the next run cleans the dead run's temp folder and succeeds
    subprocess.run([sys.executable, "-m", "gqakit", "convert", str(src), str(out), "-g", "2", "-q"], check=True)
    assert out.is_dir() and not [p for p in tmp_path.iterdir() if ".gqakit-tmp-" in p.name]


def test_help_has_examples(capsys):
    try:
        main(["convert", "--help"])
    except SystemExit as exc:
        assert not exc.code
    out = capsys.readouterr().out
    assert "Examples:" in out and "--num-kv-heads" in out


def test_inspect_reports_each_valid_g(src, capsys):
    main(["inspect", str(src), "--json", "--batch", "4", "--context", "100", "--dtype-bytes", "2"])
    info = json.loads(capsys.readouterr().out)
    assert info["dtype_bytes"] == 2 and info["dtype"] == "16-bit"  # asked for: named by its width
    assert [o["kv_heads"] for o in info["options"]] == [4, 2, 1]
    # 2 layers * 2 (k,v) * G * head_dim 4 * 2 bytes
    assert [o["kv_bytes_per_token"] for o in info["options"]] == [128, 64, 32]
    assert info["options"][2]["kv_cache_bytes"] == 32 * 4 * 100
    assert info["options"][1]["parameters_removed"] == 2 * 2 * (4 - 2) * 4 * 32
