"""The vLLM step of bench/gpu_proof.sh: gqakit's serving check and the capacity bench in vLLM
on the GPU, SmolLM2-135M original (3 KV heads) against G = 1, both made from the GGUF.

When vLLM is not importable (no `.venv-vllm`, no $GQAKIT_VLLM_PYTHON, no vllm in this python:
the GPU machine may have no registry access), it says so in one line, records the step as
skipped and exits 0. Likewise without the GGUF ($GQAKIT_SMOLLM2). Otherwise:

1. `gqakit convert GGUF WORK/vllm-g3 -g 3 --method mean` and `... vllm-g1 -g 1 --method mean`
   (float32 folders, the GGUF dequantised);
2. `gqakit eval FOLDER --engine vllm --check` for each -> vllm_check_g3.json, vllm_check_g1.json;
3. `python -m bench.bench_vllm_capacity G3 G1` at a fixed KV budget -> vllm_capacity.json;
then OUT/vllm.json: the two checks' verdicts and the capacity summary.

--dry: only the lookup (a dry run on a CPU must not start vLLM); the step is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import write_json

CAPACITY = ["--kv-budget", "1GiB", "--requests", "256", "--prompt", "128", "--output", "128", "--runs", "3",
            "--dtype", "float32"]


def skip(out: Path, why: str) -> None:
    print(f"gpu_vllm: skipped: {why}", flush=True)
    write_json(out / "vllm.json", {"status": f"skipped: {why}"})


def run(cmd: list[str]) -> int:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=("gpu", "dry"), default="gpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--source", type=Path, default=os.environ.get("GQAKIT_SMOLLM2") or None)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from gqakit.engines import EngineMissing
    from gqakit.engines.vllm import find_python

    try:
        vllm_python = find_python()
    except EngineMissing as e:
        skip(a.out, f"vLLM is not importable here ({e})")
        return 0
    if a.profile == "dry":
        skip(a.out, f"dry run: vLLM found ({vllm_python}); a GPU run checks and measures SmolLM2 in it")
        return 0
    if a.source is None or not Path(a.source).is_file():
        skip(a.out, "GQAKIT_SMOLLM2 does not name the SmolLM2 GGUF")
        return 0
    gqakit = [sys.executable, "-m", "gqakit"]
    folders = {g: a.work / f"vllm-g{g}" for g in (3, 1)}
    result: dict[str, Any] = {"vllm_python": vllm_python, "source": str(a.source), "checks": {}}
    for g, folder in folders.items():
        if not (folder / "config.json").is_file() and run(
                [*gqakit, "convert", str(a.source), str(folder), "-g", str(g), "--method", "mean", "-q"]):
            result["status"] = f"failed: gqakit convert -g {g}"
            write_json(a.out / "vllm.json", result)
            return 1
    rc = 0
    for g, folder in folders.items():
        out = a.out / f"vllm_check_g{g}.json"
        code = run([*gqakit, "eval", str(folder), "--engine", "vllm", "--check", "--device", "cuda", "--out", str(out),
                    "--overwrite"])
        block = json.loads(out.read_text()).get("serving", {}) if out.is_file() else {}
        result["checks"][f"g{g}"] = {"exit": code, "passed": block.get("passed"), "agreement": block.get("agreement"),
                                     "unexplained": block.get("unexplained"),
                                     "max_abs_logprob_diff": block.get("max_abs_logprob_diff"),
                                     "kv": {k: block.get("kv", {}).get(k) for k in
                                            ("allocated_bytes_per_token", "predicted_bytes_per_token", "match")}}
        rc = rc or code
    cap = a.out / "vllm_capacity.json"
    code = run([sys.executable, "-m", "bench.bench_vllm_capacity", str(folders[3]), str(folders[1]), *CAPACITY,
                "--out", str(cap)])
    result["capacity"] = json.loads(cap.read_text())["summary"] if cap.is_file() else None
    result["status"] = "ok" if not (rc or code) else f"failed (serving check exit {rc}, capacity exit {code})"
    write_json(a.out / "vllm.json", result)
    return 1 if rc or code else 0


if __name__ == "__main__":
    sys.exit(main())
