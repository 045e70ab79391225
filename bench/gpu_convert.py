"""Step 3 of `bench/gpu_proof.sh`: a streamed, calibrated conversion of a 7B-shaped checkpoint.

Builds a random Llama-2-7B-shaped MHA checkpoint (hidden 4096, 32 layers, 32 heads, MLP
11008, vocab 32000, bf16, about 12.6 GiB) on disk, then runs

    gqakit convert SRC OUT -g 8 --method align-refit --effort fast --device cuda \\
        --calibration-data TEXT --calibration-tokens 131072

(`--effort fast`: the closed-form fits, whose memory and time this step measures; reconstruction
steps on random weights would only add time.)

in this process (through the CLI's own entry point), so that
`torch.cuda.max_memory_allocated` after it is the conversion's peak GPU memory; the
peak host RSS (VmHWM, reset before the conversion) is recorded too. The calibration
text is standard-library docstrings, built in code (`../shared` is not on a GPU machine).

Besides wall time and peak memory it records the conversion's own calibration record
(tokens, where the streams lived, residual drift) and checks the GPU memory
target: peak allocated <= 2 x one decoder block (in the compute dtype) + the two streams.

    python -m bench.gpu_convert --profile gpu --out OUT --work WORK
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from bench import gpu_proof  # profiles and synthetic inputs
from bench.common import folder_bytes, say, write_json

def _vmhwm_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def convert_once(p: dict[str, Any], work: Path, *, device: str | None,
                 phase: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Build the source checkpoint and calibration text, convert, measure; folders removed after."""
    import torch

    from gqakit.core.device import proc_bytes

    c = p["convert"]
    phase("build")
    tok = gpu_proof.tokenizer(work, p)
    # About 4 characters per token of this BPE; 8 per token leaves room.
    text = gpu_proof.text_file(work, p).read_text()[: 8 * c["calibration_tokens"]]
    calib = work / "calibration.txt"
    calib.write_text(text)
    n_tok = len(tok(text, add_special_tokens=False)["input_ids"])
    if n_tok < c["calibration_tokens"]:
        raise RuntimeError(f"calibration text has {n_tok:,} tokens, fewer than the {c['calibration_tokens']:,} asked for")
    src, out = work / "convert-src", work / "convert-out"
    build_device = device or p["device"]
    say(f"convert: building the {c['layers']}-layer source checkpoint on {build_device}")
    source = gpu_proof.build_llama(src, c, c["heads"], device=build_device, dtype=p["dtype"], tok=tok)
    say(f"convert: source {gpu_proof.count(source['parameters'])} params, {source['bytes_on_disk'] / 2**30:.2f} GiB, "
        f"built in {source['build_s']} s; calibration text {n_tok:,} tokens")
    argv = ["convert", str(src), str(out), "-g", str(c["kv_heads"]), "--method", c["method"], "--effort", "fast",
            *(["--device", device] if device is not None else []),
            "--calibration-data", str(calib), "--calibration-tokens", str(c["calibration_tokens"]), "--overwrite",
            *([] if os.environ.get("GQAKIT_PROOF_PROGRESS") else ["-q"])]
    phase("convert")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _vmhwm_reset()
    # what the process already held (building the source leaves heap the allocator keeps): the
    # peak below cannot fall under it, so the conversion's own share is the difference
    rss_start = proc_bytes("/proc/self/status", "VmRSS:")
    t0 = time.perf_counter()
    gpu_proof.run_cli(argv)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak_gpu = int(torch.cuda.max_memory_allocated()) if cuda else None
    cfg = json.loads((out / "config.json").read_text())
    cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    per_layer = source["parameters"] // c["layers"]  # upper bound: embeddings and head counted in
    block_bytes = (c["hidden"] * c["hidden"] * 4 + 3 * c["hidden"] * c["intermediate"]) * (
        8 if cal["compute_dtype"] == "float64" else 4)
    budget = 2 * block_bytes + (cal["stream_bytes"] if cal["streams_on"] == "device" else 0)
    if cfg.get("num_key_value_heads") != c["kv_heads"]:
        raise RuntimeError(f"output has {cfg.get('num_key_value_heads')} KV heads, expected {c['kv_heads']}")
    res = {"command": "gqakit " + " ".join(argv).replace(str(work) + "/", "WORK/"), "device": device or "default",
           "wall_s": round(wall, 2), "peak_gpu_memory_allocated": peak_gpu,
           "peak_gpu_memory_reserved": int(torch.cuda.max_memory_reserved()) if cuda else None,
           "peak_host_rss": proc_bytes("/proc/self/status", "VmHWM:"),
           "host_rss_at_start": rss_start,
           "note": ("no GPU memory was allocated in this process: did the conversion run elsewhere?"
                    if cuda and device and device.startswith("cuda") and not peak_gpu else None),
           "calibration_text_tokens": n_tok, "source": source, "output_bytes_on_disk": folder_bytes(out),
           "output_kv_heads": cfg["num_key_value_heads"],
           "calibration": {k: cal[k] for k in ("tokens", "seq_len", "batch", "device", "compute_dtype", "stream_dtype",
                                               "streams_on", "stream_bytes", "seconds", "peak_memory_bytes")},
           "final_residual_drift": (cal["residual_drift"] or [None])[-1],
           "calibration_tokens_per_s_per_layer": round(cal["tokens"] * c["layers"] / cal["seconds"], 1),
           "block_bytes": block_bytes, "params_per_layer_upper_bound": per_layer,
           "gpu_memory_target_bytes": budget if cuda else None,
           "gpu_memory_within_target": (peak_gpu <= budget) if cuda and peak_gpu else None}
    gb = lambda n: "n/a" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    say(f"convert: {wall:.1f} s, peak GPU memory {gb(peak_gpu)} (max_memory_allocated), "
        f"peak host RSS {gb(res['peak_host_rss'])}")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(gpu_proof.PROFILES), default="gpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    if os.environ.get("GQAKIT_PROOF_TRACE_S"):  # where a slow conversion spends its time: stacks every N s
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["GQAKIT_PROOF_TRACE_S"]), repeat=True)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    p = {**gpu_proof.PROFILES[args.profile], "name": args.profile}
    path = args.out / "convert.json"
    res: dict[str, Any] = {"status": "running", "phase": "check", "profile": args.profile, "settings": p["convert"],
                           "run": gpu_proof.run_facts(p["device"])}
    write_json(path, res)

    def set_phase(name: str) -> None:
        res["phase"] = name
        write_json(path, res)

    res["result"] = convert_once(p, args.work, device=p["device"], phase=set_phase)
    res.update(status="ok", phase="done")
    write_json(path, res)


if __name__ == "__main__":
    main()
