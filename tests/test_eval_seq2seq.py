"""`gqakit eval` / `compare` on encoder-decoders: perplexity of the target tokens given the input
(span-corrupted held-out text, paired JSONL), the one-line errors, and lm-evaluation-harness
tasks on its seq2seq backend.

The references are written here: the corrupted examples are built by hand from the noise mask
(core.spans, tested in test_spans.py), and each target is scored by shifting it right behind the
model's decoder start token and summing log-softmax at the target ids, with no `labels=`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gqakit.core.spans import SpanCorruption, sentinel_ids
from gqakit.eval.perplexity import PerplexitySettings, Spans, Window
from gqakit.eval.results import EvalResult, read_results
from gqakit.eval.runner import run_eval
from tiny_models import build_seq2seq
from cli_helpers import run_cli as cli

TEXT = " ".join(f"the dog {i % 7} ran to the cat {i % 5}, and they sat." for i in range(40))
PAIRS = [{"input": f"say {w} twice", "target": f"{w} {w}."} for w in ("dog", "cat", "sun", "tree", "ball")]
CONTEXT = 48

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2s")
    return {kind: build_seq2seq(kind, root / kind) for kind in ("t5", "t5_v1_1", "mt5", "bart")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2s_data")
    (root / "d.txt").write_text(TEXT)
    long = {"input": "a very long input " * 8, "target": "short."}  # cut to --context tokens
    (root / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in [*PAIRS, long]))
    return root




def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gqakit: error: "), err
    return lines[0]


def load(folder: Path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    return AutoModelForSeq2SeqLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def target_nll(model, inp: list[int], tgt: list[int]) -> float:
    """-log p(target | input), the decoder fed the target shifted right by hand."""
    start = model.config.decoder_start_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([inp]), decoder_input_ids=torch.tensor([[start] + tgt[:-1]])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -float(logp[torch.arange(len(tgt)), torch.tensor(tgt)].sum())


def corrupt_by_hand(ids: list[int], mask: list[bool], sentinels: list[int], eos: int) -> tuple[list[int], list[int]]:
    inp, tgt, k = [], [], 0
    for i, tok in enumerate(ids):
        if mask[i] and (i == 0 or not mask[i - 1]):
            inp.append(sentinels[k])
            tgt.append(sentinels[k])
            k += 1
        (tgt if mask[i] else inp).append(tok)
    return inp + [eos], tgt + [eos]


def span_reference(folder: Path, text: str, context: int, seed: int) -> tuple[float, int, list[int]]:
    """(NLL, target tokens, input lengths): the text cut into runs of source_length(context) tokens,
    the last shorter run kept, each corrupted by hand from its noise mask."""
    model, tok = load(folder)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    sc = SpanCorruption()
    n = sc.source_length(context)
    runs = [ids[i:i + n] for i in range(0, len(ids), n)]
    runs = [r for r in runs if len(r) >= 2]
    nll, count, lengths = 0.0, 0, []
    for index, run in enumerate(runs):
        mask = sc.noise_mask(len(run), seed=seed, index=index)
        inp, tgt = corrupt_by_hand(run, mask, sentinel_ids(tok), tok.eos_token_id)
        nll += target_nll(model, inp, tgt)
        count += len(tgt)
        lengths.append(len(inp))
    return nll, count, lengths


def ppl(model: Path, data: Path, **kw) -> EvalResult:
    window = Window(context=kw.pop("context", CONTEXT))
    return run_eval(model, perplexity=PerplexitySettings(data=data, window=window, **kw), progress=False, quiet=True)


@pytest.mark.parametrize("kind", ["t5", "t5_v1_1", "mt5"])
def test_span_corruption_perplexity_equals_reference(kind, models, files):
    res = ppl(models[kind], files / "d.txt")
    p = res.perplexity
    nll, count, lengths = span_reference(models[kind], TEXT, CONTEXT, seed=0)
    assert p.objective == "span_corruption" and p.kind == "span_corruption"
    assert p.tokens == count and p.examples == len(lengths) and p.input_tokens == sum(lengths)
    assert max(lengths) == CONTEXT and lengths[:-1] == [CONTEXT] * (len(lengths) - 1)  # input length = --context
    assert math.isclose(p.nll_sum, nll, rel_tol=1e-5)
    assert math.isclose(p.token_perplexity, math.exp(nll / count), rel_tol=1e-5)
    assert p.spans.seed == 0 and p.spans.noise_density == 0.15 and p.spans.mean_span_length == 3.0
    assert p.spans.source_tokens == SpanCorruption().source_length(CONTEXT) and p.spans.sentinels == 16
    assert "bits_per_byte" not in p.to_json() and "stride" not in p.to_json()  # targets are fragments of words
    # the model block: the decoder's geometry, the encoder's apart, both caches per token
    m = res.model
    assert m.heads == m.kv_heads == 4 and m.layers == 2 and m.encoder.heads == m.encoder.kv_heads == 4
    assert m.kv_bytes_per_token == m.cross_kv_bytes_per_token == 2 * 2 * 4 * m.head_dim * 4


def test_span_corruption_is_deterministic_for_a_seed(models, files):
    a, b = ppl(models["t5"], files / "d.txt"), ppl(models["t5"], files / "d.txt")
    c = ppl(models["t5"], files / "d.txt", spans=Spans(seed=1))
    assert a.perplexity.nll_sum == b.perplexity.nll_sum
    assert c.perplexity.spans.seed == 1 and c.perplexity.nll_sum != a.perplexity.nll_sum
    nll, count, _ = span_reference(models["t5"], TEXT, CONTEXT, seed=1)
    assert math.isclose(c.perplexity.nll_sum, nll, rel_tol=1e-5) and c.perplexity.tokens == count


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_paired_perplexity_equals_reference(kind, models, files):
    context = 24
    res = ppl(models[kind], files / "p.jsonl", objective="paired", context=context)
    p = res.perplexity
    model, tok = load(models[kind])
    rows = [json.loads(line) for line in (files / "p.jsonl").read_text().splitlines()]
    nll, count = 0.0, 0
    for row in rows:
        inp = tok(row["input"], truncation=True, max_length=context)["input_ids"]  # cut as the tokenizer cuts
        assert len(inp) <= context
        tgt = tok(text_target=row["target"])["input_ids"]
        nll += target_nll(model, inp, tgt)
        count += len(tgt)
    words = sum(len(r["target"].split()) for r in rows)
    nbytes = sum(len(r["target"].encode()) for r in rows)
    assert p.objective == "paired" and p.examples == len(rows) and p.tokens == count and p.inputs_truncated == 1
    assert math.isclose(p.nll_sum, nll, rel_tol=1e-5)
    assert math.isclose(p.token_perplexity, math.exp(nll / count), rel_tol=1e-5)
    assert p.words == words and p.bytes == nbytes
    assert math.isclose(p.bits_per_byte, nll / nbytes / math.log(2), rel_tol=1e-5)
    assert p.fields.input == "input" and p.fields.target == "target" and p.data["examples"] == len(rows)
    again = ppl(models[kind], files / "p.jsonl", objective="paired", context=context)
    assert again.perplexity.nll_sum == p.nll_sum


def test_results_and_compare_say_which_perplexity(models, files, tmp_path, capsys):
    span, paired, paired_bart = tmp_path / "span.json", tmp_path / "paired.json", tmp_path / "bart.json"
    code, out, err = cli(["eval", models["t5"], "--data", files / "d.txt", "--context", CONTEXT, "--span-seed", 3,
                          "--out", span, "-q"], capsys)
    assert code == 0, err
    assert "span-corruption perplexity" in out and "seed 3" in out
    for model, out_file in ((models["t5"], paired), (models["bart"], paired_bart)):
        code, out, err = cli(["eval", model, "--data", files / "p.jsonl", "--objective", "paired", "--context", 24,
                              "--out", out_file, "-q"], capsys)
        assert code == 0 and "paired perplexity" in out, err
    data = json.loads(span.read_text())
    assert list(data["perplexity"])[0] == "objective" and data["perplexity"]["spans"]["seed"] == 3
    assert "stride" not in data["perplexity"] and data["model"]["encoder"]["kv_heads"] == 4
    res = read_results(span)
    assert json.dumps(res.to_json(), indent=2) + "\n" == span.read_text()  # reads back byte for byte

    code, _, err = cli(["compare", paired, paired_bart, span, "--names", "t5-paired,bart-paired,t5-span",
                        "--out", tmp_path / "rep", "-q"], capsys)
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["t5-paired"]["perplexity_objective"] == "paired" and rows["t5-span"]["perplexity_objective"] == \
        "span_corruption"
    assert rows["bart-paired"]["perplexity_delta_pct"] is not None and rows["t5-span"]["perplexity_delta_pct"] is None
    assert rep["perplexity_settings"]["objective"] == "paired" and rep["perplexity_settings"]["fields"] == \
        {"input": "input", "target": "target"}
    assert "perplexity (paired-data, span-corruption)" in md and "(span-corruption)" in md
    assert "Perplexity (paired data): of the target tokens given the input" in md
    assert "Perplexity (span corruption): of the target tokens" in md and "seed 3)" in md  # each kind's settings
    assert list(rep["perplexity_settings_by_objective"]) == ["paired", "span_corruption"]
    assert any("t5-span has span-corruption perplexity, t5-paired paired-data perplexity" in w
               for w in rep["warnings"])
    assert "cross-attention cache" in md and rows["t5-span"]["cross_kv_bytes_per_token"] == 512


def test_compare_of_span_corruption_runs(models, files, tmp_path, capsys):
    outs = []
    for seed in (0, 0, 1):
        out = tmp_path / f"s{len(outs)}.json"
        assert cli(["eval", models["t5"], "--data", files / "d.txt", "--context", CONTEXT, "--span-seed", seed,
                    "--out", out, "-q"], capsys)[0] == 0
        outs.append(out)
    code, _, err = cli(["compare", *outs, "--out", tmp_path / "rep", "-q"], capsys)
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert "| perplexity (span-corruption) |" in md and "Perplexity (span corruption)" in md and "seed 0" in md
    assert rep["rows"][1]["perplexity_delta_pct"] == 0
    assert rep["warnings"] == ["s2 was evaluated with different span seed than s0: their perplexities are not "
                               "comparable"]


def test_one_line_errors(models, files, tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps({"input": "x", "answer": "y"}) + "\n")
    cases = [
        ([models["bart"], "--data", files / "d.txt"], "sentinel tokens"),
        ([models["t5"], "--data", bad, "--objective", "paired"], f"{bad} line 3: no 'target' field"),
        ([models["t5"], "--data", files / "d.txt", "--objective", "paired"], "line 1: not valid JSON"),
        ([models["t5"], "--data", files / "d.txt", "--objective", "causal_lm"], "is an encoder-decoder"),
        ([tiny_model("llama"), "--data", files / "d.txt", "--objective", "span_corruption"],
         "needs an encoder-decoder model"),
        ([models["t5"], "--data", files / "d.txt", "--stride", 8], "--stride applies to a decoder"),
        ([models["t5"], "--data", files / "d.txt", "--context", 400], "use --context at most"),
        ([models["t5"], "--data", files / "d.txt", "--context", 2], "too short for a span-corrupted example"),
        ([models["t5"], "--data", "hf:x", "--objective", "paired"], "not a dataset"),
        ([models["t5"], "--objective", "paired"], "--objective goes with --data"),
        ([models["bart"], "--data", files / "p.jsonl", "--objective", "paired", "--context", 200, "-q"],
         "larger than the model's 128 positions"),  # BART's learned positions (-q: after the loading bars)
        ([models["t5"], "--data", files / "p.jsonl", "--objective", "paired", "--input-field", "target"],
         "two different names"),
    ]
    for args, msg in cases:
        line = one_line_error(*cli(["eval", *args, "--out", out], capsys)[::2])
        assert msg in line, line
    assert not out.exists()


def test_t5_positions_are_relative(files, tmp_path):
    """T5's n_positions is nominal (relative position buckets): inputs may be longer."""
    folder = build_seq2seq("t5", tmp_path / "t5", n_positions=16)
    assert ppl(folder, files / "d.txt").perplexity.context == CONTEXT > 16


def test_span_errors_come_before_the_model_loads(models, files, monkeypatch):
    from gqakit.core import loading
    from gqakit.core.errors import GqakitError

    monkeypatch.setattr(loading, "load_seq2seq_lm", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(GqakitError, match="sentinel"):
        ppl(models["bart"], files / "d.txt")


def test_flag_defaults_are_the_settings_defaults():
    from gqakit.eval.cli import eval_cmd

    flags = {p.name: p.default for p in eval_cmd.params}
    s = PerplexitySettings(data="d.txt")
    assert (flags["objective"], flags["span_seed"], flags["input_field"], flags["target_field"]) == \
        (s.objective, s.spans.seed, s.input_field, s.target_field)


# ----------------------------------------------------------------------------- tasks

def task_folder(tmp_path: Path) -> Path:
    from test_eval_tasks import write_task

    folder = write_task(tmp_path / "tasks", n=6)
    data = folder / "roll.jsonl"
    data.write_text("".join(json.dumps({"text": f"the dog {i} ran."}) + "\n" for i in range(3)))
    (folder / "roll.yaml").write_text(
        f"task: s2s_roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\nmetadata:\n  version: 1.0\n")
    return folder


def test_tasks_on_a_seq2seq_model_equal_the_harness(models, tmp_path, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from test_eval_tasks import METRICS, TASK

    folder, out = task_folder(tmp_path), tmp_path / "t.json"
    code, stdout, err = cli(["eval", models["t5"], "--tasks", TASK, "--tasks-path", folder, "--out", out, "-q"],
                            capsys)
    assert code == 0, err
    ours = json.loads(out.read_text())["tasks"]["results"][TASK]
    ref = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(models["t5"]), "backend": "seq2seq",
                                                          "dtype": "float32", "device": "cpu"},
                                  tasks=[TASK], task_manager=TaskManager(include_path=str(folder),
                                                                         include_defaults=False),
                                  log_samples=False)["results"][TASK]
    for metric in METRICS:
        assert ours["metrics"][metric]["value"] == pytest.approx(ref[f"{metric},none"], abs=1e-9), metric
    assert ours["samples"]["effective"] == 6


def test_a_task_seq2seq_cannot_run_is_refused_before_loading(models, tmp_path, capsys, monkeypatch):
    from gqakit.core import loading

    folder = task_folder(tmp_path)
    monkeypatch.setattr(loading, "load_seq2seq_lm", lambda *a, **k: pytest.fail("model loaded"))
    line = one_line_error(*cli(["eval", models["t5"], "--tasks", "gqakit_test_mc,s2s_roll", "--tasks-path", folder,
                                "--out", tmp_path / "t.json", "-q"], capsys)[::2])
    assert "task s2s_roll is a loglikelihood_rolling task" in line and "--data" in line


# ----------------------------------------------------------------------------- a GQA encoder-decoder

@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_gqa_model_perplexity_and_info(kind, models, files, tmp_path, capsys):
    """A GQA folder (gqakit's shipped modeling file, decoder K/V pooled to 2 heads) loads without
    --trust-remote-code; its perplexity equals the stock multi-head model's with the pooled heads
    repeated back, and compare shows its heads and caches beside the original's."""
    from test_remote_seq2seq import write_folder

    import shutil

    gqa = write_folder(models[kind], tmp_path / "gqa", kind, 2, 4)
    ref = write_folder(models[kind], tmp_path / "ref", kind, 2, 4, as_stock=True)
    for folder in (gqa, ref):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(models[kind] / f, folder / f)
    args = (["--data", files / "d.txt", "--context", CONTEXT] if kind == "t5" else
            ["--data", files / "p.jsonl", "--objective", "paired", "--context", 24])
    outs = {}
    for name, folder in (("mha", models[kind]), ("gqa", gqa), ("ref", ref)):
        outs[name] = tmp_path / f"{name}.json"
        code, _, err = cli(["eval", folder, *args, "--out", outs[name], "-q"], capsys)
        assert code == 0, err
    res = {n: read_results(p) for n, p in outs.items()}
    g, r = res["gqa"], res["ref"]
    assert g.model.model_type == f"gqakit_{kind}" and g.model.kv_heads == 2 and g.model.heads == 4
    assert g.model.encoder.kv_heads == 4 and r.model.kv_heads == 4
    assert g.model.kv_bytes_per_token == g.model.cross_kv_bytes_per_token == r.model.kv_bytes_per_token / 2
    assert g.perplexity.tokens == r.perplexity.tokens
    assert math.isclose(g.perplexity.nll_sum, r.perplexity.nll_sum, rel_tol=1e-5)
    assert g.perplexity.nll_sum != res["mha"].perplexity.nll_sum  # pooling changed the model
    code, _, err = cli(["compare", outs["mha"], outs["gqa"], "--out", tmp_path / "rep", "-q"], capsys)
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| 2 / 4 |" in md and "gqa: encoder 4 / 4 KV heads, cross-attention cache 256 B (float32) per input token" in md
