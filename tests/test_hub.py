"""Hugging Face Hub ids as model arguments (`core/hub.py`), on a real cache layout built on disk.

Every test runs with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at a cache written here, laid
out as huggingface_hub writes it: `models--org--name/blobs/<hash>` holding the files,
`snapshots/<commit>/<file>` symlinks to them, `refs/main` naming the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from gqakit.cli import main
from gqakit.core.errors import GqakitError
from gqakit.core.hub import ModelRef, hub_id_of, parse_hub_id, resolve_model_ref

REV = "0123456789abcdef0123456789abcdef01234567"
REV2 = "fedcba9876543210fedcba9876543210fedcba98"
TEXT = " ".join(chr(33 + (i * 7) % 61) for i in range(300))


def put_in_cache(cache: Path, repo_id: str, folder: Path, commit: str = REV, branch: str | None = "main") -> Path:
    """FOLDER's files as the snapshot COMMIT of REPO_ID in the hub cache CACHE; returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if branch:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch, tiny_model):
    """A hub cache holding `org/tiny-llama` (a pico llama, 8 heads), offline; the working
    directory is an empty folder, so no local path shadows the id."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    src = tiny_model("llama", num_attention_heads=8, num_key_value_heads=8)
    snap = put_in_cache(cache, "org/tiny-llama", src)
    shutil.rmtree(src)  # only the cache holds it now
    return cache, snap, work


def ok(args: list[str], capsys) -> str:
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def fails(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_parse_hub_id():
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_an_id in ("./org/name", "/abs/org/name", "name", "a/b/c", "org/model.gguf", "org--x/y", "~/a/b",
                      "org/na me", "org/name@", "org/-name"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_resolve_reads_the_cache_and_names_the_commit(hub):
    cache, snap, _ = hub
    ref = resolve_model_ref("org/tiny-llama")
    assert ref == ModelRef(snap, "org/tiny-llama", None, REV)
    assert ref.hub_id == ref.name == "org/tiny-llama"
    assert ref.record() == {"repo_id": "org/tiny-llama", "revision": "main", "commit": REV}
    pinned = resolve_model_ref(f"org/tiny-llama@{REV}")
    assert pinned.path == snap and pinned.hub_id == f"org/tiny-llama@{REV}"
    # a local path, or something no Hub id could be, is left to the caller as a path
    assert resolve_model_ref("missing-folder") == ModelRef(Path("missing-folder"))


def test_hf_home_is_respected(hub, monkeypatch, tmp_path):
    cache, snap, _ = hub
    home = tmp_path / "hf-home"
    shutil.copytree(cache, home / "hub", symlinks=True)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model_ref("org/tiny-llama").path == home / "hub" / snap.relative_to(cache)


def test_convert_from_a_hub_id_records_the_id_not_the_cache_path(hub, capsys):
    cache, snap, work = hub
    ok(["convert", "org/tiny-llama", "out", "-g", "2", "--method", "mean", "-q"], capsys)
    out = work / "out"
    card = (out / "README.md").read_text()
    assert front_matter(card)["base_model"] == "org/tiny-llama"
    assert "# tiny-llama → GQA (2 KV heads)" in card and "| source | `org/tiny-llama` |" in card
    assert str(cache) not in card and str(work) not in card  # no local path in a card meant for sharing
    rec = json.loads((out / "gqakit_convert.json").read_text())["settings"]
    assert rec["source_hub"] == {"repo_id": "org/tiny-llama", "revision": "main", "commit": REV}
    assert rec["source"] == str(snap)  # the local record keeps the folder it read
    from gqakit.core.loading import load_causal_lm

    assert load_causal_lm(out).config.num_key_value_heads == 2


def test_convert_from_a_pinned_revision(hub, capsys):
    cache, snap, work = hub
    # a second commit, reachable only by its hash (refs/main still names the first)
    put_in_cache(cache, "org/tiny-llama", snap, commit=REV2, branch=None)
    ok(["convert", f"org/tiny-llama@{REV2}", "out", "-g", "4", "--method", "mean", "-q"], capsys)
    card = (work / "out" / "README.md").read_text()
    assert front_matter(card)["base_model"] == f"org/tiny-llama@{REV2}"
    rec = json.loads((work / "out" / "gqakit_convert.json").read_text())["settings"]
    assert rec["source_hub"] == {"repo_id": "org/tiny-llama", "revision": REV2, "commit": REV2}


@pytest.mark.parametrize("verb", [["convert", "{id}", "out", "-g", "2"], ["inspect", "{id}"],
                                  ["eval", "{id}", "--data", "d.txt", "--out", "r.json"]])
@pytest.mark.parametrize("ref,hint", [("org/missing", "hf download org/missing"),
                                      ("org/tiny-llama@v2", "hf download org/tiny-llama --revision v2")])
def test_a_missing_id_is_one_line_with_the_download_command(hub, capsys, verb, ref, hint):
    cache, _, work = hub
    (work / "d.txt").write_text(TEXT)
    before = sorted(p.relative_to(cache.parent) for p in cache.parent.rglob("*"))
    err = fails([a.replace("{id}", ref) for a in verb], capsys)
    assert f"model {ref} is not in the Hugging Face cache ({cache}" in err and err.rstrip().endswith(hint), err
    assert sorted(p.relative_to(cache.parent) for p in cache.parent.rglob("*")) == before  # nothing written


def test_a_partial_snapshot_says_so(hub, capsys, tmp_path):
    cache, _, _ = hub
    only_config = tmp_path / "cfg-only"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    put_in_cache(cache, "org/half", only_config)
    err = fails(["inspect", "org/half"], capsys)
    assert "model org/half is only partly in the Hugging Face cache" in err and "hf download org/half" in err


def test_a_local_folder_named_like_the_id_wins(hub, capsys, tiny_model):
    _, _, work = hub
    local = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4)
    (work / "org").mkdir()
    shutil.copytree(local, work / "org" / "tiny-llama")
    info = json.loads(ok(["inspect", "org/tiny-llama", "--json"], capsys))
    assert info["kv_heads"] == 4  # the local folder's, not the cached model's 8
    ok(["convert", "org/tiny-llama", "out", "-g", "2", "--method", "mean", "-q"], capsys)
    rec = json.loads((work / "out" / "gqakit_convert.json").read_text())["settings"]
    assert "source_hub" not in rec and rec["source"] == str(work / "org" / "tiny-llama")


def test_inspect_from_a_hub_id(hub, capsys):
    info = json.loads(ok(["inspect", "org/tiny-llama", "--json"], capsys))
    assert info["source"] == "org/tiny-llama" and info["kv_heads"] == 8 and info["query_heads"] == 8
    assert ok(["inspect", "org/tiny-llama"], capsys).startswith("org/tiny-llama: llama")


def test_eval_from_a_hub_id_records_the_id(hub, capsys):
    _, _, work = hub
    (work / "d.txt").write_text(TEXT)
    ok(["eval", "org/tiny-llama", "--data", "d.txt", "--context", "32", "--out", "r.json", "-q"], capsys)
    model = json.loads((work / "r.json").read_text())["model"]
    assert model["path"] == "org/tiny-llama"
    assert model["hub"] == {"repo_id": "org/tiny-llama", "revision": "main", "commit": REV}
    assert model["kv_heads"] == 8


def test_uptrain_student_and_teacher_from_hub_ids(hub, tmp_path, capsys):
    from gqakit.convert import convert_checkpoint
    from gqakit.uptrain import run_uptrain
    from gqakit.uptrain.preflight import preflight

    cache, snap, work = hub
    # the Python API takes a Hub id too
    g2 = convert_checkpoint("org/tiny-llama", tmp_path / "g2", 2, method="mean", progress=False)
    student = put_in_cache(cache, "org/tiny-llama-g2", g2, commit=REV2)
    texts = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40)) for i in range(24)]
    cfg = {"model": {"path": "org/tiny-llama-g2"}, "teacher": {"path": "org/tiny-llama", "kl_weight": 1.0},
           "data": {"texts": texts},
           "train": {"tokens": 16 * 2 * 3, "seq_len": 16, "micro_batch": 2, "lr": 1e-3, "warmup_steps": 1,
                     "precision": "fp32"},
           "output": {"dir": str(work / "run"), "save_every": 100}, "logging": {"every": 1, "tensorboard": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    plan = ok(["uptrain", str(tmp_path / "c.yaml"), "--dry-run", "--device-memory", "24GB"], capsys)
    assert "weights float32" in plan and "fits 24GB device" in plan, plan  # the memory plan of the cached model
    checked = preflight(cfg)
    assert checked.src == student.resolve() and checked.teacher == snap.resolve()
    final = run_uptrain(cfg, quiet=True)
    settings = yaml.safe_load((final / "gqakit_uptrain.yaml").read_text())["settings"]
    assert settings["model"]["path"] == "org/tiny-llama-g2" and settings["teacher"]["path"] == "org/tiny-llama"
    for key, ref in (("model", "org/missing"), ("teacher", "org/gone")):
        bad = {**cfg, key: {**cfg[key], "path": ref}}
        with pytest.raises(GqakitError, match=rf"^{key}.path: model {ref} is not in the Hugging Face cache .*"
                                              rf"download it with: hf download {ref}$"):
            preflight(bad)


def test_base_model_of_a_local_source(tmp_path, tiny_model, capsys, monkeypatch):
    """A local folder: a card's base_model is a Hub id the folder says it is a copy of, else absent."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = tiny_model("llama")
    ok(["convert", str(src), str(tmp_path / "plain"), "-g", "2", "--method", "mean", "-q"], capsys)
    card = (tmp_path / "plain" / "README.md").read_text()
    assert "base_model" not in front_matter(card) and str(src.resolve()) not in card
    assert f"| source | `{src.name}` |" in card
    # a config whose _name_or_path is a Hub id
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "someone/base-model"}))
    ok(["convert", str(src), str(tmp_path / "named"), "-g", "2", "--method", "mean", "-q"], capsys)
    assert front_matter((tmp_path / "named" / "README.md").read_text())["base_model"] == "someone/base-model"
    # a snapshot folder of a Hugging Face cache, given as a path
    snap = put_in_cache(tmp_path / "cache", "org/snap-model", src)
    assert hub_id_of(snap) == "org/snap-model" and hub_id_of(snap / "model.gguf") == "org/snap-model"
    assert hub_id_of(src) is None and hub_id_of(src, {"_name_or_path": str(src)}) is None


@pytest.mark.parametrize("env,local_only", [(None, True), ("1", True), ("0", False)])
def test_the_network_only_when_the_user_allows_it(monkeypatch, tmp_path, env, local_only):
    """gqakit is offline unless HF_HUB_OFFLINE=0; online, a failed download is the same one line."""
    import huggingface_hub

    calls = []

    def fake(repo_id, **kw):
        calls.append(kw["local_files_only"])
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    if env is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", env)
    with pytest.raises(GqakitError, match=r"^model org/name is not in the Hugging Face cache .*; download it with: "
                                          r"hf download org/name$") as e:
        resolve_model_ref("org/name")
    assert calls == [local_only]
    assert ("the download failed: connection refused" in str(e.value)) is not local_only
