"""A step of `bench/gpu_proof.sh`: align-refit at its defaults on a 7B-shaped checkpoint, against
a 20-minute target for the whole 32-layer model on one GPU.

Builds a random Llama-2-7B-shaped MHA checkpoint with a few of its layers (hidden 4096, 32 heads,
MLP 11008, bf16; `layers` in the profile), then, through the CLI's own entry point in this process,

    gqakit convert SRC OUT -g 8 --method align-refit --device cuda \\
        --calibration-data TEXT --calibration-tokens 65536 --dry-run     # the probe's estimate
    gqakit convert SRC OUT -g 8 --method align-refit --device cuda \\
        --calibration-data TEXT --calibration-tokens 65536               # the defaults: --effort best

and records the calibration's seconds per layer (the record's `seconds` over its layers; every
layer of the shape costs the same), the 32-layer projection (preparation + 32 x per layer)
against the 20-minute target, and the dry run's estimate against the measured time.

    python -m bench.gpu_refit --profile gpu --out OUT --work WORK
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from bench import gpu_proof
from bench.common import say, write_json

TARGET_S = 20 * 60  # the whole 7B model's refit at the defaults, one GPU
PROFILES = {"gpu": {"layers": 2, "full_layers": 32, "calibration_tokens": 65_536},
            "dry": {"layers": 2, "full_layers": 4, "calibration_tokens": 256}}


def _seconds(text: str) -> float:
    """'about 3 min 07 s' (stage.duration) in seconds."""
    total = 0.0
    for n, unit in re.findall(r"(\d+) (h|min|s)\b", text):
        total += int(n) * {"h": 3600, "min": 60, "s": 1}[unit]
    return total


def refit_once(p: dict[str, Any], r: dict[str, Any], work: Path) -> dict[str, Any]:
    c = {**p["convert"], "layers": r["layers"]}
    tok = gpu_proof.tokenizer(work, p)
    calib = work / "calibration.txt"
    calib.write_text(gpu_proof.text_file(work, p).read_text()[: 8 * r["calibration_tokens"]])
    src, out = work / "convert-src", work / "convert-out"
    source = gpu_proof.build_llama(src, c, c["heads"], device=p["device"], dtype=p["dtype"], tok=tok)
    argv = ["convert", str(src), str(out), "-g", str(c["kv_heads"]), "--method", "align-refit",
            "--device", p["device"], "--calibration-data", str(calib),
            "--calibration-tokens", str(r["calibration_tokens"]), "--overwrite"]
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        gpu_proof.run_cli([*argv, "--dry-run"])
    dry_s = time.perf_counter() - t0
    line = next((x for x in buf.getvalue().splitlines() if x.startswith("expected time:")), "")
    say(f"refit: dry run {dry_s:.1f} s: {line}")
    t0 = time.perf_counter()
    gpu_proof.run_cli([*argv, "-q"])
    wall = time.perf_counter() - t0
    cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    per_layer = cal["seconds"] / c["layers"]
    projected = per_layer * r["full_layers"]
    expected = _seconds(line.split("for the calibration")[0])
    res = {"command": "gqakit " + " ".join(argv).replace(str(work) + "/", "WORK/"), "source": source,
           "layers_run": c["layers"], "wall_s": round(wall, 2), "calibration_s": cal["seconds"],
           "seconds_per_layer": round(per_layer, 2), "full_layers": r["full_layers"],
           "projected_full_s": round(projected, 1), "target_s": TARGET_S, "within_target": projected <= TARGET_S,
           "dry_run_line": line, "dry_run_expected_s": expected, "dry_run_s": round(dry_s, 2),
           "dry_run_error": round(expected / cal["seconds"] - 1, 3) if cal["seconds"] else None,
           "steps": cal["options"]["steps"], "step_dtype": cal["options"].get("step_dtype"),
           "reconstruction": cal.get("reconstruction")}
    say(f"refit: {per_layer:.1f} s per layer; {r['full_layers']} layers: {projected:.0f} s "
        f"(target {TARGET_S} s: {'met' if res['within_target'] else 'missed'}); dry run said {expected:.0f} s "
        f"for {c['layers']} layers, measured {cal['seconds']:.0f} s")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(gpu_proof.PROFILES), default="gpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    p = {**gpu_proof.PROFILES[args.profile], "name": args.profile}
    r = PROFILES[args.profile]
    path = args.out / "refit.json"
    res: dict[str, Any] = {"status": "running", "phase": "refit", "profile": args.profile, "settings": r,
                           "run": gpu_proof.run_facts(p["device"])}
    write_json(path, res)
    res["result"] = refit_once(p, r, args.work)
    res.update(status="ok", phase="done")
    write_json(path, res)


if __name__ == "__main__":
    main()
