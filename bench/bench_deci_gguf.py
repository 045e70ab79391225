"""Does llama.cpp serve a per-layer (`deci`) GGUF as gqakit reads it, and where do its tokens
part from transformers' when they do?

For each GGUF, llama.cpp (llama-cpp-python, greedy, one thread) generates from the serving
check's prompts (`gqakit.engines.check.make_prompts`: windows of its fixed English passage),
once per KV-cache type (`--kv`, F32 and F16 by default). Each generation is scored
teacher-forced, as `gqakit eval --check` scores it, by:

- `reference`: gqakit's reading of the same file (`gqakit.engines.llamacpp_ref`: its tensors
  dequantised, q/k un-permuted per layer; what the check uses);
- `reference_q8`: the same model with each matmul whose GGUF weight is quantised fed its input
  rounded as llama.cpp rounds it (8 bits per block of 32, `bench_llamacpp_rounding.round_like_q8`);
  only for a GGUF with quantised matmul weights;
- `folder`: a model folder given with `--folder GGUF=FOLDER` (e.g. the folder conversion with the
  same plan from the same source: other K/V bytes where the GGUF requantised them).

Per (GGUF, cache, teacher): positions, agreement, each mismatch's gap (the teacher's log-prob of
its argmax minus of llama.cpp's token, nats) and the largest |log-prob difference| of llama.cpp's
tokens; for `reference_q8` also how far the rounding alone moves the reference's log-prob of
llama.cpp's tokens (`rounding_moves_logprob_by`).

`--control SRC.gguf` (a `llama` GGUF): SRC rewritten byte for byte as a `deci` GGUF whose
per-layer head counts are all SRC's (a temporary file), and llama.cpp's greedy tokens and
log-probs on both files compared: whether llama.cpp's `deci` graph computes what its `llama`
graph computes on the same quantised weights.

    python -m bench.bench_deci_gguf --gguf plan-f32.gguf --gguf plan-q41.gguf --folder plan-q41.gguf=plan-folder \
        --control SmolLM2.Q4_1.gguf

Writes bench/results/deci_gguf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench.bench_llamacpp_rounding import BLOCK, round_like_q8
from bench.common import RESULTS, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FLOAT_TYPES = {"F32", "F16", "BF16"}


def quantised_inputs(types: dict[str, str], tied: bool) -> set[str]:
    """The modules (state-dict prefixes) whose matmul llama.cpp runs on 8-bit activations: those
    whose weight's GGUF type (TYPES: state-dict name -> type name) is not a float type; a tied LM
    head multiplies by the token embedding's type."""
    out = {n.removesuffix(".weight") for n, t in types.items() if n.endswith(".weight") and t not in FLOAT_TYPES}
    embed = [n for n in types if n.endswith("embed_tokens.weight")]
    if tied and embed and types[embed[0]] not in FLOAT_TYPES:
        out.add("lm_head")
    out.discard(embed[0].removesuffix(".weight") if embed else "")  # a lookup, not a matmul
    return out


def rounding_hooks(model, modules: set[str]) -> list:
    """Forward pre-hooks that round the input of each nn.Linear named in MODULES as llama.cpp does."""
    import torch

    def hook(_module, args):
        x = args[0]
        return None if x.shape[-1] % BLOCK else (round_like_q8(x), *args[1:])

    return [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
            if n in modules and isinstance(m, torch.nn.Linear)]


def score(gen, prompts, teacher, plain: list | None = None) -> tuple[dict, list]:
    """The row of one teacher, and its log-probs; PLAIN: the unrounded teacher's log-probs, to
    report how far the rounding alone moves the log-prob of llama.cpp's tokens."""
    from gqakit.engines.check import judge, teacher_logprobs

    lps = teacher_logprobs(teacher, prompts, gen.tokens)
    positions, mismatches = judge(gen.tokens, lps, float("inf"))

    def at(tables):
        return [float(lp[t, tok]) for toks, lp in zip(gen.tokens, tables) for t, tok in enumerate(toks)]

    engine = [float(e) for elps in gen.logprobs for e in elps]
    row = {"positions": positions, "agree": positions - len(mismatches),
           "gaps": sorted(round(m.margin, 4) for m in mismatches),
           "max_abs_logprob_diff": round(max(abs(a - b) for a, b in zip(at(lps), engine)), 5)}
    if plain is not None:
        row["rounding_moves_logprob_by"] = round(max(abs(a - b) for a, b in zip(at(lps), at(plain))), 5)
    return row, lps


def measure(path: Path, folder: Path | None, kv_types: list[str], n: int, new: int, length: int,
            threads: int) -> list[dict]:
    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.engines.base import EngineOptions
    from gqakit.engines.check import make_prompts
    from gqakit.engines.llamacpp import LlamaCppEngine
    from gqakit.core.loading import load_tokenizer
    from gqakit.engines.llamacpp_ref import reference_model, tensor_map

    torch.set_num_threads(threads)
    ref = reference_model(path)
    types = {k: t.tensor_type.name for k, t in tensor_map(path, ref).items()}
    prompts, source = make_prompts(n, length, int(ref.config.vocab_size), load_tokenizer(path))
    teachers = {"reference": (ref, set())}
    rounded = quantised_inputs(types, bool(ref.config.tie_word_embeddings))
    if rounded:
        teachers["reference_q8"] = (ref, rounded)
    if folder is not None:
        teachers["folder"] = (load_causal_lm(folder, dtype=torch.float32), set())
    rows = []
    for kv in kv_types:
        engine = LlamaCppEngine(kv_type=kv)
        engine.load(path, EngineOptions(max_len=length + new, threads=threads))
        try:
            gen = engine.generate(prompts, new)
        finally:
            engine.close()
        plain = None
        for name, (model, modules) in teachers.items():
            handles = rounding_hooks(model, modules)
            try:
                r, lps = score(gen, prompts, model, plain if modules else None)
            finally:
                for h in handles:
                    h.remove()
            plain = lps if name == "reference" else plain
            row = {"gguf": path.name, "kv_cache": kv, "teacher": name, "prompts": n, "new_tokens": new,
                   "prompt_len": length, "prompt_source": source, **r}
            say(json.dumps(row))
            rows.append(row)
    return rows


def as_deci(src: Path, out: Path) -> None:
    """SRC (a GGUF of one head count per model) written to OUT as llama.cpp's `deci`: every tensor's
    bytes and every key as they are, `{arch}.*` keys renamed `deci.*`, the head counts as
    per-layer arrays of SRC's counts."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    layers = int(r.fields[f"{arch}.block_count"].contents())
    per_layer = {f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"}
    w = gguf.GGUFWriter(str(out), "deci")
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        name = "deci." + f.name[len(arch) + 1:] if f.name.startswith(arch + ".") else f.name
        vtype = f.types[0]
        if f.name in per_layer:
            w.add_key_value(name, [int(f.contents())] * layers, gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.UINT32)
        else:
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()


def control(src: Path, kv_types: list[str], n: int, new: int, length: int, threads: int) -> list[dict]:
    """llama.cpp on SRC and on SRC as `deci` (`as_deci`): same tokens, log-probs apart by how much."""
    import tempfile

    from gqakit.engines.base import EngineOptions
    from gqakit.engines.check import make_prompts
    from gqakit.engines.llamacpp import LlamaCppEngine
    from gqakit.engines.llamacpp_ref import load_tokenizer

    tok = load_tokenizer(src)
    prompts, source = make_prompts(n, length, len(tok), tok)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-deci-") as tmp:
        deci = Path(tmp) / f"{src.stem}.deci.gguf"
        as_deci(src, deci)
        for kv in kv_types:
            gens = []
            for path in (src, deci):
                engine = LlamaCppEngine(kv_type=kv)
                engine.load(path, EngineOptions(max_len=length + new, threads=threads))
                try:
                    gens.append(engine.generate(prompts, new))
                finally:
                    engine.close()
            a, b = gens
            diff = max(abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb))
            row = {"control": src.name, "kv_cache": kv, "prompts": n, "new_tokens": new, "prompt_len": length,
                   "prompt_source": source, "same_tokens": a.tokens == b.tokens, "max_abs_logprob_diff": diff}
            say(json.dumps(row))
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, action="append", default=[])
    ap.add_argument("--folder", action="append", default=[], metavar="GGUF=FOLDER",
                    help="also score against this model folder for the GGUF of that path")
    ap.add_argument("--control", type=Path, action="append", default=[],
                    help="a llama GGUF to compare with itself written as deci")
    ap.add_argument("--kv", action="append", choices=["F32", "F16"], help="llama.cpp KV-cache types (F32 and F16)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "deci_gguf.json")
    a = ap.parse_args()
    folders = {Path(k).resolve(): Path(v) for k, _, v in (f.partition("=") for f in a.folder)}
    rows = []
    for path in a.gguf:
        rows += measure(path, folders.get(path.resolve()), a.kv or ["F32", "F16"], a.prompts, a.tokens, a.prompt_len,
                        a.threads)
    for src in a.control:
        rows += control(src, a.kv or ["F32", "F16"], a.prompts, a.tokens, a.prompt_len, a.threads)
    import llama_cpp

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                 "machine": platform.processor() or platform.machine(),
                                 "cpus": os.cpu_count(), "threads": a.threads, "llama_cpp_python": llama_cpp.__version__,
                                 "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
