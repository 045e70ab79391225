"""Hostile and unlucky runs: `--overwrite` deletes only what gqakit wrote, a failed run
leaves nothing, hostile YAML is one line, and a source that vanishes is named as unread.

Same world and the same three assertions as `test_hostile.py`: the exit code, exactly
one `gqakit: error:` line naming the file or field, and every pre-existing file
byte-identical (nothing added, nothing removed).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml

from test_hostile import (assert_refused, assets, cache_of, refused, run_cli, snapshot, uptrain_tree,  # noqa: F401
                          world, write_cfg)



def _laughs(first: str) -> list[str]:
    """The nine anchored lists of a "billion laughs": each holds nine of the one before."""
    names = "abcdefghi"
    return [f"&{a} [" + ", ".join([first if i == 0 else "*" + names[i - 1]] * 9) + "]" for i, a in enumerate(names)]


BOMB = "".join(f"{a}: {body}\n" for a, body in zip("abcdefghi", _laughs('"lol"')))  # 9^9 values in nine lines


# ============================================================================ --overwrite, at any depth


@pytest.mark.parametrize("planted", [
    "checkpoints/mine/notes.txt",          # a folder of the user's inside checkpoints/
    "checkpoints/step-4/notes.txt",        # a file inside a checkpoint
    "checkpoints/empty/",                  # an empty folder of the user's
    "model/notes.txt",                     # a file inside the final model
    "model/sub/notes.txt",
    "uptrain/notes.txt",                   # a file in the tensorboard folder
    "uptrain/1700000000.5/notes.txt",
])
def test_overwrite_refuses_a_run_holding_a_file_of_the_users(world, assets, capfd, planted):
    path = world / "run" / planted
    if planted.endswith("/"):
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("mine")
    refused(world, ["uptrain", write_cfg(world, assets), "--overwrite", "-q"], capfd, "output.dir", repr(planted),
            "which gqakit did not write")


def test_overwrite_refuses_a_run_without_its_manifest(world, assets, capfd):
    """Only the manifest says gqakit wrote a folder: a run's own files without it (its
    settings file, log and checkpoints) are not enough to replace it."""
    (world / "run" / ".gqakit-output.json").unlink()
    refused(world, ["uptrain", write_cfg(world, assets), "--overwrite", "-q"], capfd,
            "output.dir", "was not written by gqakit (no .gqakit-output.json)")
    assert (world / "run" / "gqakit_uptrain.yaml").is_file()


def test_overwrite_replaces_a_run_with_its_tensorboard_logs_and_checkpoints(world, assets, capfd):
    """What gqakit itself wrote (checkpoints, tensorboard events and hyper-parameters, the
    final model) is replaced, so the rule above does not refuse gqakit's own runs."""
    pytest.importorskip("tensorboard")
    cfg = write_cfg(world, assets, out=world / "tb", tokens=16 * 2 * 4)
    args = ["uptrain", cfg, "logging.tensorboard=true", "output.save_every=2", "-q"]
    code, _, err = run_cli(args, capfd)
    assert code == 0 and err == "", err
    assert list((world / "tb" / "uptrain").rglob("events.out.tfevents.*")), "the test needs tensorboard files"
    assert list((world / "tb" / "checkpoints").glob("step-*"))
    code, _, err = run_cli([*args, "--overwrite"], capfd)
    assert code == 0 and err == "", err
    # A stale checkpoint temp folder (a save cut short by SIGKILL) is gqakit's too.
    (world / "tb" / "checkpoints" / ".step-9.tmp").mkdir()
    (world / "tb" / "checkpoints" / ".step-9.tmp" / "model.safetensors").write_bytes(b"half")
    code, _, err = run_cli([*args, "--overwrite"], capfd)
    assert code == 0 and err == "", err
    assert not (world / "tb" / "checkpoints" / ".step-9.tmp").exists()


# ============================================================================ a failed run leaves nothing


def test_divergence_before_the_first_checkpoint_leaves_nothing(world, assets, capfd):
    cfg = write_cfg(world, assets, out=world / "new", tokens=16 * 2 * 30)
    refused(world, ["uptrain", cfg, "train.lr=1e8", "train.warmup_steps=0", "output.save_every=50", "-q"], capfd,
            "training diverged", "no checkpoint was saved yet")
    assert not (world / "new").exists()
    # the corrected run is not refused: no --overwrite needed
    code, _, err = run_cli(["uptrain", cfg, "-q"], capfd)
    assert code == 0 and err == "", err
    assert (world / "new" / "model" / "model.safetensors").is_file()


def test_disk_full_at_the_first_checkpoint_leaves_nothing(world, assets, capfd, monkeypatch):
    import accelerate

    def full(self, output_dir=None, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", output_dir)

    monkeypatch.setattr(accelerate.Accelerator, "save_state", full)
    cfg = write_cfg(world, assets, out=world / "new" / "deeper")
    refused(world, ["uptrain", cfg, "output.save_every=2", "-q"], capfd, "no space left",
            str(world / "new" / "deeper" / "checkpoints"))


def test_failed_export_without_checkpoints_leaves_nothing_but_the_users_empty_folder(world, assets, capfd,
                                                                                      monkeypatch):
    """The run folder existed, empty (the user made it): it stays, empty."""
    from gqakit.core.errors import GqakitError
    from gqakit.uptrain import export

    def full(*a, **kw):
        raise GqakitError(f"no space left on the device while writing {world / 'new' / 'model'}")

    monkeypatch.setattr(export, "export_model", full)
    (world / "new").mkdir()
    refused(world, ["uptrain", write_cfg(world, assets, out=world / "new"), "-q"], capfd, "no space left", "model")
    assert (world / "new").is_dir() and not any((world / "new").iterdir())


def test_ctrl_c_before_the_first_checkpoint_leaves_nothing(world, assets, capfd, monkeypatch):
    from gqakit.uptrain import trainer

    def ctrl_c(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_step", ctrl_c)
    cfg = write_cfg(world, assets, out=world / "new")
    before = snapshot(world)
    code, _, err = run_cli(["uptrain", cfg, "-q"], capfd)
    line = assert_refused(code, err.replace("gqakit: interrupted: ", "gqakit: error: "), "nothing was kept",
                          exit_code=130)
    assert "--overwrite" not in line
    assert snapshot(world) == before


def test_a_failed_run_with_a_checkpoint_is_kept_and_resumes(world, assets, capfd, monkeypatch):
    from gqakit.core.errors import GqakitError
    from gqakit.uptrain import trainer

    real, calls = trainer.save_checkpoint, []

    def save_then_fail(*a, **kw):
        real(*a, **kw)
        calls.append(1)
        if len(calls) == 2:
            raise GqakitError("no space left on the device while writing the log")

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_fail)
    cfg = write_cfg(world, assets, out=world / "new", tokens=16 * 2 * 6)
    code, _, err = run_cli(["uptrain", cfg, "output.save_every=2", "-q"], capfd)
    assert_refused(code, err, "no space left")
    assert sorted(p.name for p in (world / "new" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    monkeypatch.undo()
    code, _, err = run_cli(["uptrain", cfg, "output.save_every=2", "--resume", "-q"], capfd)
    assert code == 0 and err == "", err


# ============================================================================ hostile YAML


def test_yaml_alias_bomb_in_the_config_is_one_line(world, assets, capfd):
    cfg = world / "bomb.yaml"
    tree = yaml.safe_load(write_cfg(world, assets, out=world / "new").read_text())
    cfg.write_text(BOMB + yaml.safe_dump(tree))
    refused(world, ["uptrain", cfg, "-q"], capfd, "bomb.yaml", "alias")
    refused(world, ["uptrain", cfg, "--dry-run"], capfd, "bomb.yaml", "alias")


def test_yaml_alias_bomb_in_an_override_is_one_line(world, assets, capfd):
    flow = "[" + ", ".join(_laughs("x")) + "]"
    refused(world, ["uptrain", write_cfg(world, assets, out=world / "new"), f"train.trainable={flow}", "-q"], capfd,
            "override", "train.trainable", "alias")


def test_recursive_deep_or_huge_yaml_is_one_line(world, assets, capfd):
    cfg = world / "bad.yaml"
    for text, needle in (("model: &m {path: *m}\n", "recursive"),
                         ("model: " + "[" * 500 + "]" * 500 + "\n", "nested"),
                         ("# " + "x" * (9 << 20) + "\n", "MiB")):
        cfg.write_text(text)
        refused(world, ["uptrain", cfg, "-q"], capfd, "bad.yaml", needle)


def test_alias_bomb_in_the_runs_settings_on_resume(world, assets, capfd):
    (world / "run" / "gqakit_uptrain.yaml").write_text(BOMB)
    refused(world, ["uptrain", write_cfg(world, assets, tokens=16 * 2 * 6), "--resume", "-q"], capfd,
            "--resume", "gqakit_uptrain.yaml", "alias")


def test_eval_skips_an_alias_bomb_in_the_models_uptrain_record(world, capfd):
    """eval reads the model's gqakit_uptrain.yaml for its seen-in-training check: a bomb there
    is skipped (the check is advisory) instead of hanging."""
    model = world / "run" / "model"
    (model / "gqakit_uptrain.yaml").write_text(BOMB)
    code, _, err = run_cli(["eval", model, "--data", world / "data" / "eval.txt", "--context", 16,
                            "--out", world / "r.json", "-q"], capfd)
    assert code == 0 and err == "", err
    assert json.loads((world / "r.json").read_text())["perplexity"]["token_perplexity"] > 1


# ============================================================================ a source that vanishes


def test_source_deleted_during_convert_is_named_as_unreadable(world, capfd, monkeypatch):
    from gqakit.convert import io as convert_io

    src = world / "mha"
    real = convert_io.ShardWriter.finish

    def vanish_then_finish(self, *a, **kw):
        shutil.rmtree(src)
        return real(self, *a, **kw)

    monkeypatch.setattr(convert_io.ShardWriter, "finish", vanish_then_finish)
    before = {k: v for k, v in snapshot(world).items() if not k.startswith("mha")}
    code, _, err = run_cli(["convert", src, world / "out", "-g", 2, "-q"], capfd)
    line = assert_refused(code, err, "could not read", str(src), "moved or deleted")
    assert "write" not in line
    assert snapshot(world) == before
