"""bench/bench_convert_io.py end to end at a pico shape: every number it reports is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_one_round_reports_times_cpu_and_memory(tmp_path: Path):
    out = tmp_path / "convert_io.json"
    subprocess.run([sys.executable, "-m", "bench.bench_convert_io", "--workdir", str(tmp_path / "w"), "--hidden", "64",
                    "--layers", "2", "--heads", "4", "--intermediate", "64", "--vocab", "128", "-g", "2",
                    "--rounds", "1", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    res = json.loads(out.read_text())
    row = res["rounds"][0]
    for key in ("cp", "convert", "startup"):
        assert row[f"{key}_seconds"] > 0 and row[f"{key}_cpu"] > 0
        assert 0 <= row[f"{key}_sys_cpu"] <= row[f"{key}_cpu"]
    assert row["convert_cpu"] >= row["convert_sys_cpu"] and row["peak_rss_anon"] > 0
    assert res["output_bytes"] < res["source_bytes"]  # 4 -> 2 KV heads
    assert not (tmp_path / "w" / "out").exists()  # removed without --keep
