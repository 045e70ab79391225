"""The GPU proof's summary, step by step: the markdown each step's results become (`step_md`),
and the number formats they share (`count`, `gib`). `bench.gpu_proof.summary` writes the page."""

from __future__ import annotations

from typing import Any

def count(n: float | None) -> str:
    """1.10 B, 15.3 M or 115,008: parameter counts at any size."""
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,.0f}"


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def step_md(step: str, data: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """Markdown lines for one step's results; fills `entry` (its part of gpu_proof.json)."""
    md: list[str] = []
    if step.startswith("decode") and data.get("rows") is not None:
        from bench import bench_decode

        md += [bench_decode.markdown(data), ""]
        entry["comparisons"] = bench_decode.comparisons(data)
    elif step == "uptrain" and data.get("result"):
        r, u = data["result"], data["settings"]
        mfu = r.get("mfu_steady")
        peak = "n/a" if r["peak_flops_per_device"] is None else f"{r['peak_flops_per_device'] / 1e12:.0f} TFLOP/s"
        mfu_txt = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
        entry["result"] = r
        md += [f"Device: {data['run'].get('device_name')}, torch {data['run'].get('torch')}, "
               f"transformers {data['run'].get('transformers')}. Model: random Llama-shaped, hidden {u['hidden']}, "
               f"{u['layers']} layers, {u['heads']} query heads, converted to {u['kv_heads']} KV heads "
               f"(`gqakit convert --method mean`), MLP {u['intermediate']}, vocab {u['vocab']}. "
               f"Mixed precision ({data['config']['train']['precision']}: bf16 on a GPU), fp32 master weights, "
               f"AdamW, all weights trained; {u['steps']} steps of {r['tokens_per_step']:,} tokens "
               f"({u['micro_batch']} x {u['seq_len']}), logged every {u['log_every']}; the first logged "
               f"interval (start-up, warm-up) is left out of the medians. MFU = tokens/s x "
               f"({r['flops_per_token_formula']}) FLOP per token, as uptrain/trainer.py counts them, "
               f"/ the device's dense bf16 peak ({peak}).",
               "",
               "| parameters | tokens/step | steps | tokens/s (median) | MFU (median) | peak GPU memory | "
               "memory plan (error) | uptrain wall s |",
               "|---|---|---|---|---|---|---|---|",
               f"| {count(r['parameters'])} | {r['tokens_per_step']:,} | {u['steps']} | "
               f"{(r['tok_per_s_steady'] or 0):,.0f} | {mfu_txt} | "
               f"{gib(r.get('peak_gpu_memory_allocated'))} | {gib(r.get('planned_peak_bytes'))}"
               + (f" ({r['plan_error']:+.1%})" if r.get("plan_error") is not None else "")
               + f" | {data.get('uptrain_s', 0):.0f} |", ""]
    elif step == "convert":
        entry["result"] = data.get("result")
        md += convert_md(data)
    elif step == "refit" and data.get("result"):
        r = entry["result"] = data["result"]
        md += [f"align-refit at its defaults ({r['steps']} steps per layer, step dtype {r['step_dtype']}) on "
               f"{r['layers_run']} layers of a random Llama-2-7B-shaped checkpoint: {r['seconds_per_layer']} s per "
               f"layer; {r['full_layers']} layers: {r['projected_full_s']:,.0f} s against the {r['target_s']:,} s "
               f"target ({'met' if r['within_target'] else 'missed'}). `--dry-run` said "
               f"{r['dry_run_expected_s']:,.0f} s, measured {r['calibration_s']:,.0f} s.", ""]
    elif step == "vllm" and data.get("checks"):
        entry["result"] = {"checks": data["checks"], "capacity": data.get("capacity")}
        for g, c in data["checks"].items():
            kv = c.get("kv") or {}
            md.append(f"- serving check {g}: {'PASS' if c.get('passed') else 'FAIL'}, agreement "
                      f"{100 * (c.get('agreement') or 0):.1f}%, {c.get('unexplained')} unexplained, KV "
                      f"{kv.get('allocated_bytes_per_token')} B/token allocated vs {kv.get('predicted_bytes_per_token')} predicted")
        cap = data.get("capacity")
        if cap:
            md.append(f"- capacity at a fixed KV budget: concurrency x{cap['concurrency_ratio']:.2f} (KV bytes "
                      f"x{cap['kv_bytes_ratio']:.2f}); throughput x{cap['throughput_ratio']:.2f} "
                      f"[{cap['throughput_ratio_range'][0]:.2f}, {cap['throughput_ratio_range'][1]:.2f}] against at most "
                      f"x{cap['throughput_ratio_predicted_max']:.2f} from bytes (vllm_capacity.json)")
        md.append("")
    elif step == "recover" and data.get("ppl", {}).get("final") is not None:
        p, w, t = data["ppl"], data["within_10_percent"], data["throughput"]
        first = "n/a" if w["first_curve_tokens"] is None else f"{w['first_curve_tokens']:,} tokens"
        mfu = "n/a" if t["mfu_median"] is None else f"{100 * t['mfu_median']:.1f}%"
        entry["result"] = {"ppl": p, "within_10_percent": w, "throughput": t}
        md += [f"{data['title']}. Perplexity by the method table's protocol; the curve is in recover.json "
               f"and recover.png.", "",
               "| original | converted (start) | final | within 10% | first curve point within 10% | tokens/s | MFU |",
               "|---|---|---|---|---|---|---|",
               f"| {p['original']:.2f} | {p['start']:.2f} | {p['final']:.2f} | {'yes' if w['final_met'] else 'no'} | "
               f"{first} | {(t['tok_per_s_median'] or 0):,.0f} | {mfu} |", ""]
    return md


def convert_md(data: dict[str, Any]) -> list[str]:
    r = data.get("result")
    if not r:
        return []
    c, cal = data["settings"], r["calibration"]
    target = r.get("gpu_memory_target_bytes")
    within = r.get("gpu_memory_within_target")
    return [f"Source: random Llama-shaped checkpoint, hidden {c['hidden']}, {c['layers']} layers, {c['heads']} "
            f"heads (MHA), MLP {c['intermediate']}, vocab {c['vocab']}, {count(r['source']['parameters'])} "
            f"params, {r['source']['dtype']}, {r['source']['bytes_on_disk'] / 2**30:.2f} GiB on disk. "
            f"Command: `{r['command']}`. Calibration: {cal['tokens']:,} tokens ({cal['seq_len']}-token sequences, "
            f"{cal['batch']} per block forward), {cal['compute_dtype']} blocks, streams in {cal['stream_dtype']} "
            f"on {cal['streams_on']} ({gib(cal['stream_bytes'])}).", "",
            "| G | method | calibration tokens | device | wall s | peak GPU memory (max_memory_allocated) "
            "| target: 2 blocks + streams | peak host RSS | residual drift, last layer |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {c['kv_heads']} | {c['method']} | {cal['tokens']:,} | {r['device']} | {r['wall_s']:.1f} | "
            f"{gib(r.get('peak_gpu_memory_allocated'))} | {gib(target)}"
            f"{'' if within is None else (' (met)' if within else ' (missed)')} | {gib(r.get('peak_host_rss'))} | "
            f"{r['final_residual_drift']:.4f} |", ""] + ([f"Note: {r['note']}", ""] if r.get("note") else [])
