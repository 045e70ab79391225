"""Markdown tables from bench/results/methods*.jsonl (the last row of each setting wins)."""

from __future__ import annotations

import json
import sys

from bench.common import RESULTS

RES = RESULTS


def rows(name: str) -> list[dict]:
    f = RES / name
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def main() -> None:
    last: dict[tuple, dict] = {}
    for r in rows("methods.jsonl"):
        # align-refit rows differ by their calibration budget: one line per budget
        # ... and by their block-wise reconstruction steps
        steps = (r.get("options") or {}).get("steps") or None
        lr = (r.get("options") or {}).get("lr") if steps else None
        last[(r["model"], r.get("G"), r["method"], (r.get("grouping"), r.get("calibration_tokens"), steps, lr))] = r
    for model in ("stories", "smollm2"):
        gs = sorted({k[1] for k in last if k[0] == model and k[1] is not None}, reverse=True)
        combos = sorted({(k[2], k[3]) for k in last if k[0] == model and k[1] is not None},
                        key=lambda c: [r for r in last if r[0] == model and (r[2], r[3]) == c][0:1] and
                        list(last).index([r for r in last if r[0] == model and (r[2], r[3]) == c][0]))
        if not gs:
            continue
        orig = last.get((model, None, "original", (None, None, None, None)))
        print(f"\n{model}" + (f" (original ppl {orig['ppl']:.2f})" if orig else ""))
        print("| method | grouping | " + " | ".join(f"G={g} ppl | G={g} convert s" for g in gs) + " |")
        print("|---|---|" + "---|---|" * len(gs))
        for method, grouping in combos:
            cells = []
            for g in gs:
                r = last.get((model, g, method, grouping))
                cells += [f"{r['ppl']:.2f}", f"{r['convert_seconds']:.1f}"] if r else ["", ""]
            label = method if grouping[1] is None else f"{method} ({grouping[1]:,} calibration tokens)"
            if grouping[2]:
                label += f" + {grouping[2]} reconstruction steps/layer (lr {grouping[3]})"
            print(f"| {label} | {grouping[0]} | " + " | ".join(cells) + " |")
    up: dict[tuple, dict] = {}
    for r in rows("methods_uptrain.jsonl"):
        up[(r["model"], r["G"], r["method"])] = r
    for model in ("stories", "smollm2"):
        keys = [k for k in up if k[0] == model]
        if not keys:
            continue
        print(f"\n{model}, equal uptraining budget per start")
        print("| G | method | ppl before | ppl after | train tokens | train s |\n|---|---|---|---|---|---|")
        for k in sorted(keys, key=lambda k: (-k[1], list(up).index(k))):
            r = up[k]
            print(f"| {k[1]} | {k[2]} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} | {r['train_tokens']:,} | "
                  f"{r['train_seconds']:.0f} |")

if __name__ == "__main__":
    sys.exit(main())
