"""bench.bench_decode_seq2seq at its tiny shape: one line per model and point, the grouped model's
measured speedup beside the bytes' prediction, the cross-attention cache in the bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_seq2seq_bench_writes_measured_beside_predicted(tmp_path):
    out = tmp_path / "s2s.jsonl"
    r = subprocess.run([sys.executable, "-m", "bench.bench_decode_seq2seq", "--shape", "tiny", "--kv-heads", "1",
                        "--batch", "2", "--input-len", "16", "--new-tokens", "2", "--reps", "1", "--threads", "1",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["model"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["g1", "mha"] and rows["g1"]["kv_heads"] == 1 and rows["mha"]["kv_heads"] == 4
    for name, row in rows.items():
        # tiny: 2 decoder layers, d_kv 16, fp32, batch 2, input 16
        assert row["bytes_per_step"]["cross_attention_kv"] == 2 * 2 * row["kv_heads"] * 16 * 16 * 4 * 2
        assert row["run"]["command"].startswith("python -m bench.bench_decode_seq2seq --shape tiny")
    c = rows["g1"]["comparison"]
    assert c["predicted_speedup_bytes"] == rows["mha"]["bytes_per_step"]["total"] / rows["g1"]["bytes_per_step"]["total"]
    assert c["measured_speedup"] > 0 and "share_of_predicted" in c
