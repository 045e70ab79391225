"""No code runs without consent: model folders and task folders that carry Python code.

A model folder's config.json `auto_map` makes transformers import a module file from the
folder; a task file's `!function module.fn` tag makes lm-evaluation-harness import
`module.py` from beside it. gqakit lets that happen only for its own modeling files,
byte-identical to the ones it ships, or with --trust-remote-code.

Every planted module writes a marker file when it is imported. Each refusal asserts, with
the helpers of `test_hostile.py`: the exit code, exactly one `gqakit: error:` line naming
the file and the flag, every file of the world byte-identical with nothing added, and no
marker.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from gqakit.core import trust
from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_causal_lm
from gqakit.core.trust import code_files, only_gqakit_code

sys.path.insert(0, str(Path(__file__).parent))
from test_hostile import EVAL, TEXTS, refused, run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "convert" / "remote" / "gqakit_modeling_gpt2.py"
FLAG = "--trust-remote-code"


def planted(marker: Path, body: str = "") -> str:
    """BODY, then Python that writes MARKER when the module is imported."""
    return f"{body}\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A pico gpt2 and its G=2 conversion (gqakit's shipped modeling file), a llama one
    (stock GQA), and text."""
    from tiny_models import build

    from gqakit.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("trust")
    convert_checkpoint(build("gpt2", root / "gpt2-mha"), root / "g2", 2, progress=False)
    convert_checkpoint(build("llama", root / "llama-mha", num_key_value_heads=8), root / "llama-g2", 2,
                       progress=False)
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n\n".join(TEXTS))
    (data / "eval.txt").write_text("\n\n".join(EVAL))
    return root


@pytest.fixture
def world(assets: Path, tmp_path: Path) -> Path:
    root = tmp_path / "w"
    root.mkdir()
    for name in ("g2", "llama-g2", "data"):
        shutil.copytree(assets / name, root / name)
    return root


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """Where planted code would leave its trace (outside the hashed world)."""
    return tmp_path / "MARKER-code-ran"


def set_auto_map(folder: Path, module: str, **config: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": f"{module}.GqakitGPT2Config", "AutoModelForCausalLM": f"{module}.GqakitGPT2LMHeadModel"}
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def edited_gqakit_file(world: Path, marker: Path) -> Path:
    """A gqakit output whose own gqakit_modeling_gpt2.py was edited."""
    f = world / "g2" / "gqakit_modeling_gpt2.py"
    f.write_text(planted(marker, f.read_text()))
    return world / "g2"


def gqakit_named_file(world: Path, marker: Path) -> Path:
    """auto_map pointing at a planted gqakit_modeling_evil.py (any name can take the prefix)."""
    folder = world / "g2"
    (folder / "gqakit_modeling_evil.py").write_text(planted(marker, SHIPPED.read_text()))
    set_auto_map(folder, "gqakit_modeling_evil")
    return folder


def plain_named_file(world: Path, marker: Path) -> Path:
    """auto_map pointing at modeling_evil.py, a module transformers needs for this model_type."""
    folder = world / "g2"
    (folder / "modeling_evil.py").write_text(planted(marker, SHIPPED.read_text()))
    set_auto_map(folder, "modeling_evil")
    return folder


def llama_with_gqakit_llama_file(world: Path, marker: Path) -> Path:
    """A llama gqakit output (stock GQA) that carries a gqakit_modeling_llama.py in its auto_map."""
    folder = world / "llama-g2"
    (folder / "gqakit_modeling_llama.py").write_text(planted(marker))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "gqakit_modeling_llama.LlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


HOSTILE = {
    "edited gqakit_modeling_gpt2.py": (edited_gqakit_file, "gqakit_modeling_gpt2.py"),
    "gqakit_modeling_evil.py": (gqakit_named_file, "gqakit_modeling_evil.py"),
    "gqakit_modeling_llama.py in a llama output": (llama_with_gqakit_llama_file, "gqakit_modeling_llama.py"),
    "modeling_evil.py": (plain_named_file, "modeling_evil.py"),
}


def uptrain_cfg(world: Path, model: Path, **extra: dict) -> Path:
    tree = {
        "model": {"path": str(model)},
        "data": {"files": [str(world / "data" / "train.txt")], "cache_dir": str(world.parent / "cache")},
        "train": {"tokens": 16 * 2 * 2, "seq_len": 16, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 1,
                  "precision": "fp32"},
        "output": {"dir": str(world / "run"), "save_every": 0},
        "logging": {"every": 1, "tensorboard": False},
        **extra,
    }
    p = world / "cfg.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


# ============================================================================ model folders


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_eval_refuses_a_folder_with_foreign_code(case, world, marker, capfd):
    plant, name = HOSTILE[case]
    folder = plant(world, marker)
    refused(world, ["eval", folder, "--data", world / "data" / "eval.txt", "--context", 16, "--out",
                    world / "r.json"], capfd, name, FLAG)
    assert not marker.exists()


@pytest.mark.parametrize("case", ["edited gqakit_modeling_gpt2.py", "gqakit_modeling_evil.py"])
def test_uptrain_refuses_foreign_code_as_model_or_teacher(case, world, marker, capfd):
    plant, name = HOSTILE[case]
    clean = world / "clean-g2"
    shutil.copytree(world / "g2", clean)
    folder = plant(world, marker)
    # as the model being trained
    refused(world, ["uptrain", uptrain_cfg(world, folder), "-q"], capfd, name, FLAG)
    assert not marker.exists()
    # as the teacher of a clean model
    cfg = uptrain_cfg(world, clean, teacher={"path": str(folder), "kl_weight": 1.0})
    refused(world, ["uptrain", cfg, "-q"], capfd, name, FLAG)
    assert not marker.exists()


@pytest.mark.parametrize("calibration", [True, False], ids=["calibration-data", "sampled-from-source"])
def test_convert_align_refit_refuses_foreign_code(calibration, world, marker, capfd):
    folder = gqakit_named_file(world, marker)
    args = ["convert", folder, world / "out", "-g", 1, "--method", "align-refit", "--calibration-tokens", 64,
            "--refit-option", "seq_len=16", "--device", "cpu", "-q"]
    if calibration:
        args += ["--calibration-data", world / "data" / "train.txt"]
    refused(world, args, capfd, "gqakit_modeling_evil.py", FLAG)
    assert not marker.exists()


def test_inspect_and_plain_convert_never_run_the_folders_code(world, marker, capfd):
    """They read config.json and the weights only: the planted code stays unrun, and the
    converted folder carries gqakit's own modeling file, which then loads without a flag."""
    folder = edited_gqakit_file(world, marker)
    code, out, err = run_cli(["inspect", folder], capfd)
    assert code == 0, err
    code, out, err = run_cli(["convert", folder, world / "out", "-g", 1, "--method", "mean", "-q"], capfd)
    assert code == 0, err
    assert (world / "out" / "gqakit_modeling_gpt2.py").read_bytes() == SHIPPED.read_bytes()
    assert only_gqakit_code(code_files(world / "out"))
    load_causal_lm(world / "out")
    assert not marker.exists()


def test_a_known_family_with_a_plain_auto_map_loads_with_transformers_own_classes(world, marker):
    """Like transformers: without consent a family it knows ignores the folder's auto_map."""
    folder = world / "llama-g2"
    (folder / "modeling_evil.py").write_text(planted(marker))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.LlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_causal_lm(folder)
    assert type(model).__module__.startswith("transformers.models.llama")
    assert not marker.exists()


# ============================================================================ what is trusted


def test_the_shipped_modeling_file_loads_without_the_flag(world, marker, capfd):
    assert (world / "g2" / "gqakit_modeling_gpt2.py").read_bytes() == SHIPPED.read_bytes()
    assert only_gqakit_code(code_files(world / "g2"))
    code, _, err = run_cli(["eval", world / "g2", "--data", world / "data" / "eval.txt", "--context", 16, "-q",
                            "--out", world / "r.json"], capfd)
    assert code == 0 and err == "", err
    assert json.loads((world / "r.json").read_text())["perplexity"]["token_perplexity"] > 1


def test_trust_remote_code_runs_the_edited_file(world, marker, capfd):
    folder = edited_gqakit_file(world, marker)
    assert not only_gqakit_code(code_files(folder))
    code, _, err = run_cli(["eval", folder, "--data", world / "data" / "eval.txt", "--context", 16, "-q",
                            "--out", world / "r.json", FLAG], capfd)
    assert code == 0, err
    assert marker.read_text() == "ran"
    assert FLAG in json.loads((world / "r.json").read_text())["run"]["command"]


def test_consent_is_scoped_to_the_verb(world, marker):
    folder = edited_gqakit_file(world, marker)
    with pytest.raises(GqakitError, match="trust-remote-code"):
        load_causal_lm(folder)
    with trust.consent(True):
        assert trust.allowed()
    assert not trust.allowed()
    assert not marker.exists()


@pytest.mark.parametrize("verb", ["convert", "eval", "uptrain"])
def test_help_says_what_the_flag_allows(verb, capfd):
    code, out, _ = run_cli([verb, "--help"], capfd)
    assert code == 0
    text = " ".join(out.split())
    assert FLAG in text and "auto_map" in text and "byte-identical" in text
    if verb == "eval":
        assert "!function" in text


@pytest.mark.parametrize("verb", ["inspect", "demo", "compare"])
def test_verbs_that_run_no_input_code_have_no_flag(verb, capfd):
    code, out, _ = run_cli([verb, "--help"], capfd)
    assert code == 0 and FLAG not in out


# ============================================================================ task folders


def task_yaml(tasks: Path, doc_to_text: str = "{{context}}") -> str:
    """A multiple-choice task `evil_mc` over a jsonl file in TASKS."""
    (tasks / "rows.jsonl").write_text("".join(json.dumps({"context": f"a {i}", "choices": ["x", "y"], "label": 0}) + "\n"
                                              for i in range(4)))
    return (f"task: evil_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'rows.jsonl'}\n"
            f"output_type: multiple_choice\ntest_split: test\ndoc_to_text: {json.dumps(doc_to_text)}\n"
            "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")


def evil_tasks(root: Path, marker: Path, *, via_include: bool = False) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    body = task_yaml(tasks)
    fn = "process_docs: !function utils.process_docs\n"
    lib = root / "lib"
    lib.mkdir()
    for where in (tasks, lib):
        (where / "utils.py").write_text(planted(marker, "def process_docs(ds):\n    return ds\n"))
    if via_include:  # the !function sits in a file outside the folder, pulled in by `include`
        (lib / "base.yaml").write_text(fn)
        (tasks / "evil.yaml").write_text(f"include: {lib / 'base.yaml'}\n{body}")
    else:
        (tasks / "evil.yaml").write_text(body + fn)
    return tasks


@pytest.mark.parametrize("via_include", [False, True], ids=["function-tag", "function-tag-in-an-include"])
def test_tasks_path_with_python_code_needs_the_flag(via_include, world, marker, capfd):
    tasks = evil_tasks(world, marker, via_include=via_include)
    line = refused(world, ["eval", world / "llama-g2", "--tasks", "evil_mc", "--tasks-path", tasks, "--out",
                           world / "r.json"], capfd, "!function", FLAG)
    assert ("base.yaml" if via_include else "evil.yaml") in line
    assert not marker.exists()


def test_tasks_path_with_the_flag_runs_the_code(world, marker, capfd):
    pytest.importorskip("lm_eval")
    tasks = evil_tasks(world, marker)
    code, _, err = run_cli(["eval", world / "llama-g2", "--tasks", "evil_mc", "--tasks-path", tasks, "--limit", 2,
                            "-q", "--out", world / "r.json", FLAG], capfd)
    assert code == 0, err
    assert marker.read_text() == "ran"


def test_the_shipped_example_tasks_need_no_flag():
    assert trust.task_code(REPO / "examples" / "tasks") == []
    trust.check_task_folder(REPO / "examples" / "tasks")


def test_a_task_template_cannot_reach_python(world, marker, capfd):
    """A Jinja template (no `!function` at all) that reaches a function's globals: the
    sandbox stops it in one line; with --trust-remote-code it renders as the harness would."""
    pytest.importorskip("lm_eval")
    tasks = world / "tasks"
    tasks.mkdir()
    reach = "{{ lipsum.__globals__['os'].popen('touch " + str(marker) + "').read() }}{{context}}"
    (tasks / "t.yaml").write_text(task_yaml(tasks, reach))
    args = ["eval", world / "llama-g2", "--tasks", "evil_mc", "--tasks-path", tasks, "--limit", 2, "-q",
            "--out", world / "r.json"]
    refused(world, args, capfd, "sandbox", FLAG)
    assert not marker.exists()
    code, _, err = run_cli(args + [FLAG], capfd)
    assert code == 0, err
    assert marker.exists()
