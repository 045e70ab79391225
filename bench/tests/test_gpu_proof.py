"""`bench/gpu_proof.sh --dry-run`: the one-call GPU measurement script, at pico size on the CPU.

A GPU run needs a machine with a CUDA GPU; the dry run goes through the same steps and code
paths every time the suite runs, so the script cannot rot unseen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gqakit.core.files import gqakit_cache_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_proof")
    # the user's gqakit cache, which the other tests' kernel builds use too: built once per machine
    env = {**os.environ, "PYTHON": sys.executable, "GQAKIT_PROOF_WORK": str(out.parent / "gpu_proof_work"),
           "GQAKIT_PROOF_CACHE": str(gqakit_cache_dir())}
    env.pop("OUT", None)
    env.pop("GQAKIT_SMOLLM2", None)
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_proof.sh"), "--dry-run", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=240)
    return out, r


def test_dry_run_finishes_and_writes_every_result(dry_run):
    out, r = dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("decode.json", "uptrain.json", "convert.json", "gpu_proof.json", "gpu_proof.md", "log.txt", "steps.tsv"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "gpu_proof.json").read_text())
    assert summary["profile"] == "dry"
    assert set(summary["steps"]) == {"decode", "uptrain", "convert", "recover", "decode-compiled", "refit", "vllm"}
    # a dry run never starts vLLM: found or not, the step says so and is skipped
    assert summary["steps"]["vllm"]["status"].startswith(("skipped: dry run", "skipped: vLLM is not importable"))
    assert summary["steps"]["recover"]["status"].startswith("skipped: GQAKIT_SMOLLM2")
    # the compiled decode step runs only when asked for (a call of its own on a GPU)
    assert summary["steps"]["decode-compiled"]["status"] == "skipped: not in GQAKIT_PROOF_STEPS"
    assert not (out / "decode_compiled.json").exists()
    for step, s in summary["steps"].items():
        assert s["status"] == "ok" or s["status"].startswith("skipped"), (step, s)
        assert s["shell"]["rc"] in (0, -2)
    # Every step's limit is recorded, and the budget was not the reason anything stopped.
    assert all(len(line.split("\t")) == 4 for line in (out / "steps.tsv").read_text().splitlines())


def test_decode_reports_measured_and_predicted_speedup(dry_run):
    out, _ = dry_run
    d = json.loads((out / "decode.json").read_text())
    assert d["complete"] and d["args"]["device"] == "cpu"
    assert {r["kv_heads"] for r in d["rows"]} == {8, 2, 1}  # MHA and both GQA models
    comps = d["comparisons"]
    assert len(comps) == 2 * len(d["rows"]) // 3
    for c in comps:
        assert c["measured_speedup"] > 0
        # Fewer KV heads: fewer bytes per step, never more.
        assert c["predicted_speedup_bytes"] > 1
        assert c["gqa_kv_cache_bytes"] * 8 == c["mha_kv_cache_bytes"] * c["kv_heads"]
    md = (out / "gpu_proof.md").read_text()
    assert "predicted by bytes" in md and "Dry run" in md


def test_uptrain_step_reads_tokens_per_second_from_the_log(dry_run):
    out, _ = dry_run
    u = json.loads((out / "uptrain.json").read_text())
    assert u["status"] == "ok" and u["config"]["train"]["cpu"] is True
    r = u["result"]
    assert r["tok_per_s_steady"] > 0 and r["final_loss"] > 0
    assert r["steps_logged"] == list(range(2, 7, 2))
    assert r["mfu_steady"] is None  # no peak FLOP/s for a CPU
    assert r["parameters"] < u["source_model"]["parameters"]  # converted to fewer KV heads
    # the run's memory plan is read from its log, set against max_memory_allocated on a GPU
    assert r["planned_peak_bytes"] > 0 and r["plan_error"] is None  # no GPU measurement in the dry run


def test_convert_step_measures_the_streamed_conversion(dry_run):
    out, _ = dry_run
    c = json.loads((out / "convert.json").read_text())
    assert c["status"] == "ok" and c["result"]["output_kv_heads"] == 2
    cal = c["result"]["calibration"]
    assert cal["device"] == "cpu" and cal["tokens"] >= 2048 and cal["seconds"] > 0
    assert c["result"]["gpu_memory_target_bytes"] is None  # no GPU in the dry run
    assert "residual drift" in (out / "gpu_proof.md").read_text()


def test_summary_records_timeouts_failures_and_steps_not_run(tmp_path: Path):
    """What the shell script writes when steps go wrong becomes a status per step, never a crash."""
    from bench import gpu_proof

    (tmp_path / "steps.tsv").write_text("decode\t124\t200.0\t200\nuptrain\t1\t12.5\t150\nconvert\t-1\t0\t3\n")
    # decode was killed after one grid point: its JSON is the one rewritten after that point.
    (tmp_path / "decode.json").write_text(json.dumps({"complete": False, "rows": [], "comparisons": []}))
    (tmp_path / "uptrain.json").write_text(json.dumps({"status": "running", "phase": "convert"}))
    res = gpu_proof.summary("gpu", tmp_path)
    st = {k: v["status"] for k, v in res["steps"].items()}
    assert st == {"decode": "timed out after 200 s", "uptrain": "failed (exit 1, in convert; see log.txt)",
                  "convert": "not run: no time left in the budget", "recover": "not run", "decode-compiled": "not run",
                  "refit": "not run", "vllm": "not run"}
    md = (tmp_path / "gpu_proof.md").read_text()
    assert "timed out after 200 s" in md and "Dry run" not in md
    assert json.loads((tmp_path / "gpu_proof.json").read_text())["steps"]["convert"]["file"] is None


def test_gpu_profile_is_valid_without_a_gpu(tmp_path: Path):
    """The GPU sizes never run here: check what can be checked (arguments, config, memory plan)."""
    from bench import bench_decode, gpu_proof

    from gqakit.uptrain.config import load_config

    p = {**gpu_proof.PROFILES["gpu"], "name": "gpu"}
    args = bench_decode.parser().parse_args(gpu_proof.decode_argv(p, tmp_path))
    assert (args.device, args.dtype, args.cuda_graphs, args.kv_heads) == ("cuda", "bfloat16", True, "8,4")
    assert not args.compile and args.out.endswith("decode.json")
    args = bench_decode.parser().parse_args(gpu_proof.decode_argv(p, tmp_path, "decode-compiled"))
    assert (args.device, args.dtype, args.compile, args.kv_heads, args.prompt_len) == ("cuda", "bfloat16", True, "8", "2048")
    assert args.out.endswith("decode_compiled.json")
    cfg = load_config(gpu_proof.uptrain_config(p, tmp_path / "m", tmp_path / "t.txt", tmp_path / "run"))
    assert cfg.train.precision == "auto" and not cfg.train.cpu
    assert cfg.train.budget() // (cfg.train.seq_len * cfg.train.micro_batch) == p["uptrain"]["steps"]
    # The decode models (bf16) leave room on an 80 GB H100 for the GQA caches of every grid point.
    d = p["decode"]
    head_dim = d["hidden"] // d["heads"]

    def weights(kv: int) -> int:
        per_layer = 2 * d["hidden"] ** 2 + 2 * d["hidden"] * kv * head_dim + 3 * d["hidden"] * d["intermediate"]
        return 2 * (d["layers"] * per_layer + 2 * d["vocab"] * d["hidden"])

    kvs = [d["heads"], *map(int, d["kv_heads"].split(","))]
    longest = max(map(int, d["prompt_len"].split(","))) + d["new_tokens"]
    biggest = max(map(int, d["batch"].split(",")))
    gqa_cache = 2 * d["layers"] * max(kvs[1:]) * head_dim * 2 * biggest * longest
    assert sum(weights(kv) for kv in kvs) + gqa_cache < 60e9


def test_recovery_dry_run_reports_curves_and_the_10_percent_verdict(tmp_path: Path):
    """bench/gpu_recover.py --dry: convert, uptrain and evaluate a pico model on the CPU;
    the results hold both curves, throughput and the verdict, and the summary renders them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_recover", "--dry", "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "recover.json").read_text())
    assert res["status"] == "ok" and res["dry"] and (tmp_path / "recover.png").is_file()
    assert not list(tmp_path.glob(".gpu_recover-*"))  # the scratch folder it made is removed
    p = res["ppl"]
    assert all(p[k] > 1 for k in ("original", "start", "final"))
    w = res["within_10_percent"]
    assert w["final_met"] == (p["final"] <= 1.1 * p["original"])
    assert len(res["loss_curve"]) >= 2 and res["ppl_curve"][0]["tokens"] == 0
    assert [c["tokens"] for c in res["ppl_curve"]] == sorted(c["tokens"] for c in res["ppl_curve"])
    assert res["throughput"]["tok_per_s_median"] > 0
    from bench import gpu_proof

    (tmp_path / "steps.tsv").write_text("recover\t0\t30.0\t3600\n")
    md = gpu_proof.summary("dry", tmp_path)["markdown"]
    assert "4. SmolLM2 G=1 recovery" in md and f"{p['final']:.2f}" in md


@pytest.mark.slow  # about a minute of torch.compile on 2 CPU cores
def test_compiled_decode_step_alone(tmp_path):
    """GQAKIT_PROOF_STEPS=decode-compiled: only that step runs (the step a GPU call makes on its own)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GQAKIT_PROOF_STEPS": "decode-compiled",
           "GQAKIT_PROOF_CACHE": str(gqakit_cache_dir())}
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_proof.sh"), "--dry-run", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.loads((out / "gpu_proof.json").read_text())["steps"]
    assert steps["decode-compiled"]["status"] == "ok"
    assert all(s["status"] == "skipped: not in GQAKIT_PROOF_STEPS" for k, s in steps.items() if k != "decode-compiled")
    d = json.loads((out / "decode_compiled.json").read_text())
    assert d["complete"] and d["args"]["compile"] is True
    assert all(r["status"] == "ok" and r["compile_s"] is not None for r in d["rows"])
    assert not (out / "decode.json").exists()


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GQAKIT_PROOF_STEPS": "decode, convrt"}
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_proof.sh"), "--dry-run", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown step 'convrt'" in r.stderr
    assert not (out / "log.txt").exists()


def test_refit_step_projects_the_whole_model_against_its_target(dry_run):
    out, _ = dry_run
    r = json.loads((out / "refit.json").read_text())["result"]
    assert r["steps"] > 0 and r["layers_run"] == 2  # the defaults: --effort best
    assert r["projected_full_s"] == pytest.approx(r["seconds_per_layer"] * r["full_layers"], rel=1e-2, abs=0.1)
    assert r["within_target"] == (r["projected_full_s"] <= r["target_s"])
    assert r["dry_run_line"].startswith("expected time: about") and r["dry_run_expected_s"] >= 0


def test_vllm_step_without_vllm_is_one_line_and_goes_on(tmp_path):
    """On a GPU machine without vLLM (no registry access to install it) the vLLM step says so in
    one line, records itself as skipped and exits 0, so the proof's other steps stand."""
    env = {**os.environ, "GQAKIT_VLLM_PYTHON": sys.executable}  # a python without vllm
    r = subprocess.run([sys.executable, "-m", "bench.gpu_vllm", "--profile", "gpu", "--out", str(tmp_path),
                        "--work", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert line.startswith("gpu_vllm: skipped: vLLM is not importable")
    status = json.loads((tmp_path / "vllm.json").read_text())["status"]
    assert status.startswith("skipped: vLLM is not importable") and not (tmp_path / "work").exists()
