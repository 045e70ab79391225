"""`gqakit eval --tasks`: lm-evaluation-harness tasks, offline, and `compare`'s task table.

The proof is equality: gqakit's numbers (through its CLI, on the model it loads) must be
the harness's own `simple_evaluate` numbers on the same model folder, loaded by the
harness itself. The task is built here: a multiple-choice YAML over a local jsonl file.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from gqakit.cli import main
from cli_helpers import run_cli as cli

TASK = "gqakit_test_mc"
METRICS = ("acc", "acc_norm")

WORDS = ["dog", "cat", "ball", "tree", "sun", "cake", "bed", "bird", "fish", "car", "toy", "hat"]


def write_task(folder: Path, name: str = TASK, n: int = 16, data_file: str | None = None) -> Path:
    """A 4-choice task over a jsonl file: the shape of ARC or HellaSwag, on local data."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    data = folder / f"{name}.jsonl"
    with data.open("w") as f:
        for i in range(n):
            a, b = rng.sample(WORDS, 2)
            choices = [f" {w}." for w in rng.sample(WORDS, 4)]
            f.write(json.dumps({"id": i, "context": f"The {a} saw the {b} and then the",
                                "choices": choices, "label": rng.randrange(4)}) + "\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_file or data}\n"
        "output_type: multiple_choice\n"
        "test_split: test\n"
        'doc_to_text: "{{context}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
        # continuous (two models never tie on it); the harness gives it no stderr
        "  - metric: brier_score\n    aggregation: brier_score\n    higher_is_better: false\n"
        "metadata:\n  version: 2.0\n")
    return folder




def harness_reference(model: Path, tasks_dir: Path, *, limit: int | None, num_fewshot: int | None = None) -> dict:
    """The harness on its own: it loads the model folder itself (`hf` model, fp32, CPU)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model), "dtype": "float32",
                                                           "device": "cpu"},
                                   tasks=[TASK], limit=limit, num_fewshot=num_fewshot,
                                   # only the local folder indexed: the same task, without a scan of
                                   # the harness's ~15,000 built-in names (seconds on a shared CPU)
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                   log_samples=False)


def assert_same(ours: dict, ref: dict, *, limit: int | None) -> None:
    row = ours["tasks"]["results"][TASK]
    want = ref["results"][TASK]
    for m in METRICS:
        assert row["metrics"][m]["value"] == want[f"{m},none"], m
        assert row["metrics"][m]["stderr"] == want[f"{m}_stderr,none"], m
    assert row["metrics"]["brier_score"]["value"] == want["brier_score,none"] > 0
    assert row["metrics"]["brier_score"]["stderr"] is None and want["brier_score_stderr,none"] == "N/A"
    assert row["version"] == ref["versions"][TASK] == 2.0
    assert row["n_shot"] == ref["n-shot"][TASK]
    assert row["samples"]["effective"] == ref["n-samples"][TASK]["effective"] == (limit or 16)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """An MHA pico model and its 2-KV-head sibling, each evaluated on the local task by the CLI."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (pip install 'gqakit[tasks]')")
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    root = tmp_path_factory.mktemp("tasks")
    tasks_dir = write_task(root / "tasks")
    outs = {}
    for name, kv in (("mha", 8), ("gqa", 2)):
        folder = build("llama", root / name, num_key_value_heads=kv)
        out = root / f"{name}.json"
        try:
            main(["eval", str(folder), "--tasks", TASK, "--tasks-path", str(tasks_dir), "--limit", "12",
                  "--device", "cpu", "--out", str(out), "-q"])
        except SystemExit as e:
            assert e.code in (0, None)
        outs[name] = (folder, out)
    return root, tasks_dir, outs


def test_tasks_equal_the_harness_own_numbers(evaluated, monkeypatch):
    root, tasks_dir, outs = evaluated
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder, out = outs["mha"]
    ours = json.loads(out.read_text())
    assert_same(ours, harness_reference(folder, tasks_dir, limit=12), limit=12)
    t = ours["tasks"]
    assert t["format"] == 1 and t["harness"]["package"] == "lm_eval"
    from importlib.metadata import version

    assert t["harness"]["version"] == version("lm_eval")
    assert t["settings"]["limit"] == 12 and t["settings"]["tasks"] == [TASK]
    data = t["results"][TASK]["dataset"]["data_files"][0]
    assert data["path"] == str((tasks_dir / f"{TASK}.jsonl").resolve()) and len(data["sha256"]) == 64
    # the two models differ: the numbers are the model's, not constants
    gqa = json.loads(outs["gqa"][1].read_text())["tasks"]["results"][TASK]["metrics"]
    assert gqa["brier_score"]["value"] != t["results"][TASK]["metrics"]["brier_score"]["value"]


def test_compare_shows_the_task_table(evaluated, tmp_path, capsys):
    root, tasks_dir, outs = evaluated
    mha, gqa = outs["mha"][1], outs["gqa"][1]
    code, out, err = cli(["compare", mha, gqa, "--names", "mha,gqa", "--out", tmp_path / "rep", "-q"], capsys)
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    a = json.loads(mha.read_text())["tasks"]["results"][TASK]["metrics"]
    b = json.loads(gqa.read_text())["tasks"]["results"][TASK]["metrics"]
    assert "## Downstream tasks (lm-evaluation-harness" in md
    assert f"| model | {TASK} acc | Δ | {TASK} acc_norm | Δ | {TASK} brier_score | Δ |" in md
    row_md = next(line for line in md.splitlines() if line.startswith("| **gqa**") and "±" in line)
    assert f"{b['acc']['value']:.4f} ± {b['acc']['stderr']:.4f}" in row_md
    assert f"{b['acc']['value'] - a['acc']['value']:+.4f}" in row_md
    assert f"| {b['brier_score']['value']:.4f} | {b['brier_score']['value'] - a['brier_score']['value']:+.4f} |" in row_md
    assert b["brier_score"]["value"] != a["brier_score"]["value"]
    rows = {r["name"]: r for r in rep["rows"]}
    for m in (*METRICS, "brier_score"):
        assert rows["gqa"]["tasks"][TASK][m]["delta"] == pytest.approx(b[m]["value"] - a[m]["value"])
        assert rows["mha"]["tasks"][TASK][m]["delta"] == 0
    assert [(c["task"], c["metric"]) for c in rep["tasks"]["columns"]] == [(TASK, m) for m in (*METRICS, "brier_score")]
    assert "tasks.png" in rep["plots"] and (tmp_path / "rep" / "tasks.png").stat().st_size > 1000
    assert not rep["warnings"]


def test_compare_warns_when_task_settings_differ(evaluated, tmp_path, capsys):
    root, tasks_dir, outs = evaluated
    res = json.loads(outs["gqa"][1].read_text())
    res["tasks"]["results"][TASK]["n_shot"] = 5
    other = tmp_path / "gqa5.json"
    other.write_text(json.dumps(res))
    code, out, err = cli(["compare", outs["mha"][1], other, "--out", tmp_path / "rep"], capsys)
    assert code == 0, err
    assert "different few-shot count" in err


def test_damaged_tasks_block_is_one_line(evaluated, tmp_path, capsys):
    res = json.loads(evaluated[2]["mha"][1].read_text())
    res["tasks"]["results"][TASK]["metrics"]["acc"]["value"] = "high"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(res))
    code, out, err = cli(["compare", bad, "--out", tmp_path / "rep"], capsys)
    assert code == 2 and "tasks.results" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "rep").exists()


@pytest.mark.assets
def test_stories260k_equals_the_harness(shared, tmp_path, capsys, monkeypatch):
    """The real model: few-shot prompts over the local task, gqakit's CLI against the harness."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (pip install 'gqakit[tasks]')")
    model = shared / "models" / "stories260K"
    tasks_dir = write_task(tmp_path / "tasks")
    out = tmp_path / "s.json"
    code, _, err = cli(["eval", model, "--tasks", TASK, "--tasks-path", tasks_dir, "--limit", "8",
                        "--num-fewshot", "2", "--device", "cpu", "--out", out, "-q"], capsys)
    assert code == 0, err
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = json.loads(out.read_text())
    assert ours["tasks"]["results"][TASK]["n_shot"] == 2
    assert_same(ours, harness_reference(model, tasks_dir, limit=8, num_fewshot=2), limit=8)


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqakit: error:"), err
    return lines[0]


def test_harness_absent_says_how_to_install(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    tasks_dir = write_task(tmp_path / "tasks")
    out = tmp_path / "r.json"
    line = one_line_error(*cli(["eval", tiny_model("llama"), "--tasks", TASK, "--tasks-path", tasks_dir,
                                "--out", out], capsys)[::2])
    assert "pip install 'gqakit[tasks]'" in line
    assert not out.exists()


def test_too_old_harness_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    import gqakit.eval.tasks as tasks

    monkeypatch.setattr(tasks, "harness_version", lambda: "0.4.2")
    line = one_line_error(*cli(["eval", tiny_model("llama"), "--tasks", TASK, "--tasks-path",
                                write_task(tmp_path / "tasks"), "--out", tmp_path / "r.json"], capsys)[::2])
    assert "found 0.4.2" in line and "pip install -U 'gqakit[tasks]'" in line


@pytest.mark.parametrize("case", ["missing-path", "file-path", "empty-dir", "no-tasks", "bad-limit",
                                  "bad-fewshot", "empty-name", "missing-data", "out-in-tasks"])
def test_bad_task_options(case, tiny_model, tmp_path, capsys):
    if case in ("missing-data",):
        pytest.importorskip("lm_eval")
    model = tiny_model("llama")
    out = tmp_path / "r.json"
    tasks_dir = write_task(tmp_path / "tasks")
    args = ["eval", model, "--out", out]
    want = {
        "missing-path": (["--tasks", TASK, "--tasks-path", tmp_path / "nowhere"], "--tasks-path not found"),
        "file-path": (["--tasks", TASK, "--tasks-path", tasks_dir / f"{TASK}.yaml"], "not a folder"),
        "empty-dir": (["--tasks", TASK, "--tasks-path", tmp_path / "empty"], "no .yaml"),
        "no-tasks": (["--limit", "5"], "go with --tasks"),
        "bad-limit": (["--tasks", TASK, "--limit", "0"], "--limit must be"),
        "bad-fewshot": (["--tasks", TASK, "--num-fewshot", "-1"], "--num-fewshot must be"),
        "empty-name": (["--tasks", "a,,b"], "comma-separated"),
        "out-in-tasks": (["--tasks", TASK, "--tasks-path", tasks_dir, "--out", tasks_dir / "r.json"], "tasks folder"),
        "missing-data": (["--tasks", "gone_mc", "--tasks-path", write_task(tmp_path / "t2", "gone_mc",
                                                                            data_file=str(tmp_path / "gone.jsonl"))],
                         "gone.jsonl, which does not exist"),
    }[case]
    (tmp_path / "empty").mkdir()
    line = one_line_error(*cli(args + want[0], capsys)[::2])
    assert want[1] in line
    assert not out.exists() and not (tasks_dir / "r.json").exists()


@pytest.fixture(scope="module")
def full_index_dir(tmp_path_factory):
    """One tasks folder for the tests that need the harness's whole task index (built once)."""
    pytest.importorskip("lm_eval")
    folder = write_task(tmp_path_factory.mktemp("idx") / "tasks")
    # a local group naming a built-in task: found in the folder, built with the whole index
    (folder / "mixed.yaml").write_text(f"group: mixed_group\ntask:\n  - {TASK}\n  - hellaswag\n")
    (folder / "broken.yaml").write_text("task: broken_t\ndoc_to_text: [unclosed\n")  # the index skips it silently
    return folder


def test_unknown_task_is_one_line_before_loading(full_index_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    line = one_line_error(*cli(["eval", tmp_path / "no-model-needed-yet", "--tasks", "hellaswagg",
                                "--tasks-path", full_index_dir, "--out", out], capsys)[::2])
    # the model path is checked first (cheap); with a real model the task name is next
    assert "model not found" in line
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    model = build("llama", tmp_path / "m")
    line = one_line_error(*cli(["eval", model, "--tasks", f"{TASK},hellaswagg", "--tasks-path", full_index_dir,
                                "--out", out], capsys)[::2])
    assert "unknown task 'hellaswagg'" in line and "did you mean hellaswag" in line
    line = one_line_error(*cli(["eval", model, "--tasks", "broken_t", "--tasks-path", full_index_dir,
                                "--out", out], capsys)[::2])
    assert "unknown task 'broken_t'" in line and "could not be read: broken.yaml" in line
    assert not out.exists()


@pytest.mark.parametrize("task", ["hellaswag", "mixed_group"])
def test_task_that_needs_the_hub_fails_offline(task, full_index_dir, tiny_model, tmp_path, capsys, monkeypatch):
    """hellaswag's data live on the Hub: offline, one line before the model loads, nothing written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    import gqakit.core.loading as loading

    loaded = []
    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("model loaded"))
    out = tmp_path / "r.json"
    line = one_line_error(*cli(["eval", tiny_model("llama"), "--tasks", task, "--tasks-path", full_index_dir,
                                "--limit", "2", "--out", out, "-q"], capsys)[::2])
    assert "hellaswag" in line and "not available offline" in line and "--tasks-path" in line
    assert not loaded and not out.exists()


def test_tasks_with_perplexity_quietly_in_one_run(tmp_path):
    """--data and --tasks together, in a fresh process: one results file, and -q prints nothing on stderr."""
    pytest.importorskip("lm_eval")
    import os
    import subprocess

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    model = build("llama", tmp_path / "m", num_key_value_heads=4)
    tasks_dir = write_task(tmp_path / "tasks")
    (tmp_path / "d.txt").write_text(" ".join(f"w{i % 11} x{i % 5}" for i in range(200)))
    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HF_DATASETS_OFFLINE", None)
    r = subprocess.run([sys.executable, "-m", "gqakit", "eval", str(model), "--data", str(tmp_path / "d.txt"),
                        "--context", "32", "--tasks", TASK, "--tasks-path", str(tasks_dir), "--limit", "4",
                        "--out", str(out), "-q"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    res = json.loads(out.read_text())
    assert res["perplexity"]["token_perplexity"] > 1
    assert res["tasks"]["results"][TASK]["samples"]["effective"] == 4
    assert f"{TASK} (4 examples): acc" in r.stdout


@pytest.mark.gpu
def test_tasks_on_gpu_follow_eval_dtype_rules(tmp_path, capsys):
    """On a GPU, --device auto puts the model on CUDA in bfloat16, and the harness run on that
    same model folder in bfloat16 on CUDA gives the same scores."""
    pytest.importorskip("lm_eval")
    sys.path.insert(0, str(Path(__file__).parent))
    import lm_eval
    from lm_eval.tasks import TaskManager
    from tiny_models import build

    model = build("llama", tmp_path / "m")
    tasks_dir = write_task(tmp_path / "tasks")
    out = tmp_path / "r.json"
    code, _, err = cli(["eval", model, "--tasks", TASK, "--tasks-path", tasks_dir, "--out", out, "-q"], capsys)
    assert code == 0, err
    ours = json.loads(out.read_text())
    assert ours["run"]["device"].startswith("cuda") and ours["run"]["dtype"] == "bfloat16"
    ref = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model), "dtype": "bfloat16",
                                                          "device": "cuda"}, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                  log_samples=False)
    for m in METRICS:
        assert ours["tasks"]["results"][TASK]["metrics"][m]["value"] == ref["results"][TASK][f"{m},none"]


def test_a_group_of_local_tasks(tiny_model, tmp_path, capsys):
    """A harness group over two local tasks: both subtasks and the group's aggregate are recorded."""
    pytest.importorskip("lm_eval")
    tasks_dir = write_task(tmp_path / "tasks", "mc_a")
    write_task(tasks_dir, "mc_b", n=6)
    (tasks_dir / "group.yaml").write_text("group: mc_group\ntask:\n  - mc_a\n  - mc_b\naggregate_metric_list:\n"
                                          "  - metric: acc\n    aggregation: mean\n    weight_by_size: true\n"
                                          "metadata:\n  version: 3.0\n")
    out = tmp_path / "r.json"
    code, stdout, err = cli(["eval", tiny_model("llama"), "--tasks", "mc_group", "--tasks-path", tasks_dir,
                             "--limit", "4", "--out", out, "-q"], capsys)
    assert code == 0, err
    t = json.loads(out.read_text())["tasks"]
    assert set(t["results"]) == {"mc_a", "mc_b"} and set(t["groups"]) == {"mc_group"}
    g = t["groups"]["mc_group"]
    assert g["subtasks"] == ["mc_a", "mc_b"]
    accs = [t["results"][n]["metrics"]["acc"]["value"] for n in ("mc_a", "mc_b")]
    assert g["metrics"]["acc"]["value"] == pytest.approx(sum(accs) / 2)  # 4 examples each
    code, _, err = cli(["compare", out, out, "--names", "a,b", "--out", tmp_path / "rep", "-q"], capsys)
    assert code == 0, err
    head = " | ".join(f"{t} {m} | Δ" for t in ("mc_a", "mc_b") for m in (*METRICS, "brier_score"))
    assert f"| model | {head} | mc_group acc | Δ |" in (tmp_path / "rep" / "report.md").read_text()


def test_the_shipped_example_task_loads_from_the_repo_root(monkeypatch):
    """examples/tasks (README's offline example): its relative data file resolves from the repo root."""
    pytest.importorskip("lm_eval")
    from gqakit.eval.tasks import TaskSettings, check_tasks, load_tasks

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    s = TaskSettings(tasks=["gqakit_stories_mc"], tasks_path=repo / "examples" / "tasks")
    check_tasks(s, quiet=True)
    (task,) = load_tasks(s, quiet=True)
    docs = list(task.test_docs())
    assert len(docs) == 20 and all(0 <= d["label"] < len(d["choices"]) == 4 for d in docs)
    monkeypatch.chdir(repo / "examples")
    with pytest.raises(Exception, match="relative to the current directory"):
        check_tasks(TaskSettings(tasks=["gqakit_stories_mc"], tasks_path=repo / "examples" / "tasks"), quiet=True)
