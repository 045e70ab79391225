"""The perplexity measurement (decoders: causal LM over a sliding window; encoder-decoders:
the target tokens given the input), as registered with `gqakit eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gqakit.core.errors import GqakitError
from gqakit.eval.measurement import IO_HEADING, Context, Flags, Measurement, flag, register
from gqakit.eval.records import OBJECTIVES, PerplexityResult


class PerplexityFlags(Flags):
    data: Any = flag("--data", lead=True, group=IO_HEADING,
                     help="Text file, or hf:NAME[:CONFIG][:SPLIT] from the local datasets cache.")
    ppl: Any = flag("--ppl/--no-ppl", lead=True, help="Measure perplexity (default: on when --data is given).")
    context: Any = flag("--context", default=512, show_default=True, help="Perplexity window, in tokens.")
    stride: Any = flag("--stride", type=int, help="Window step, in tokens (default: --context).")
    max_chars: Any = flag("--max-chars", type=int, group=IO_HEADING,
                          help="Use only the first N characters of the data.")
    text_field: Any = flag("--text-field", default="text", show_default=True, group=IO_HEADING,
                           help="Column of an hf: dataset.")
    objective: Any = flag(
        "--objective", type=click.Choice(list(OBJECTIVES)),
        help="Perplexity of what (default: by the model): causal_lm (a decoder: each token given the ones "
             "before it); for an encoder-decoder, of the target tokens given the input: span_corruption "
             "(--data is plain text, corrupted as T5 pre-trains, inputs of --context tokens) or paired "
             "(--data is JSONL of input/target objects, inputs cut to --context tokens).")
    span_seed: Any = flag("--span-seed", default=0, show_default=True,
                          help="Seed of span_corruption's spans (recorded).")
    input_field: Any = flag("--input-field", default="input", show_default=True,
                            help="Input field of --objective paired data.")
    target_field: Any = flag("--target-field", default="target", show_default=True,
                             help="Target field of --objective paired data.")


def settings(f: PerplexityFlags) -> Any:
    from gqakit.eval.perplexity import PerplexitySettings, Spans, Window

    ppl = bool(f.data) if f.ppl is None else f.ppl
    if not ppl:
        if f.objective is not None:
            raise GqakitError("--objective goes with --data (perplexity)")
        return None
    if not f.data:
        raise GqakitError("--ppl needs --data FILE (or hf:NAME[:CONFIG][:SPLIT])")
    return PerplexitySettings(data=f.data, window=Window(context=f.context, stride=f.stride),
                              max_chars=f.max_chars, text_field=f.text_field, objective=f.objective,
                              spans=Spans(seed=f.span_seed), input_field=f.input_field, target_field=f.target_field)


class Prepared:
    """What perplexity reads before the model loads: the text (or pairs), an encoder-decoder's
    examples, and the model's own training files that hold the text."""

    def __init__(self, doc: Any, examples: Any, seen: list[dict[str, str]]) -> None:
        self.doc, self.examples, self.seen = doc, examples, seen


def prepare(s: Any, model_path: str | Path, encoder_decoder: bool, quiet: bool) -> Prepared:
    from gqakit.core.quiet import quiet_libraries
    from gqakit.eval.provenance import seen_in_training

    from gqakit.core.loading import encoder_input

    doc, pairs, examples = None, None, None
    features = encoder_decoder and encoder_input(model_path) == "features"  # an audio encoder
    if features:
        from gqakit.core.pairs import read_feature_pairs

        s.objective_for(encoder_decoder, model_path, features=True)  # the data's kind, in one line
        pairs = read_feature_pairs(s.data.spec, input_field=s.input_field, target_field=s.target_field)
    elif s.objective == "paired":
        from gqakit.core.pairs import is_feature_file, read_pairs

        if is_feature_file(s.data.spec):  # audio features for a model that reads text: one line
            s.objective_for(encoder_decoder, model_path)
        pairs = read_pairs(s.data.spec, input_field=s.input_field, target_field=s.target_field)
    else:
        doc = s.read()  # fail on bad data before loading
    objective = s.objective_for(encoder_decoder, model_path, features=features)
    if objective in ("span_corruption", "paired"):
        from gqakit.core.loading import load_tokenizer
        from gqakit.eval.perplexity_seq2seq import prepare_feature_pairs, prepare_paired, prepare_span_corruption

        with quiet_libraries(quiet):  # tokenized (and span-corrupted) before the model loads
            tok = load_tokenizer(model_path)
            if features:
                doc, examples = pairs.doc, prepare_feature_pairs(tok, pairs)
            elif pairs is not None:
                doc, examples = pairs.doc, prepare_paired(tok, pairs, s)
            else:
                examples = prepare_span_corruption(tok, doc, s, model_path)
    seen = seen_in_training(model_path, doc) if doc is not None else []
    return Prepared(doc, examples, seen)


def run(ctx: Context, s: Any, prep: Prepared) -> PerplexityResult:
    if prep.examples is not None:
        from gqakit.eval.perplexity_seq2seq import score

        # learned positions (BART) limit the lengths; T5's relative ones (its n_positions is nominal) do not
        learned = hasattr(ctx.model.get_encoder(), "embed_positions")
        block = score(ctx.model, prep.examples, device=ctx.device,
                      max_positions=ctx.info.max_positions if learned else None, progress=ctx.progress)
    else:
        from gqakit.core.loading import load_tokenizer
        from gqakit.eval.perplexity import evaluate_perplexity

        block = evaluate_perplexity(ctx.model, load_tokenizer(ctx.model_path), prep.doc, s.window,
                                    device=ctx.device, max_positions=ctx.info.max_positions, progress=ctx.progress)
    if prep.seen:
        block.data["seen_in_training"] = prep.seen
    return block


def warn_seen(block: Any, prep: Prepared, quiet: bool) -> None:
    """Say when the text is part of what the model was trained on (recorded with the result too)."""
    if prep.seen and not quiet:
        seen = prep.seen
        click.echo(f"gqakit: warning: the evaluation text is part of {seen[0]['file']}, which this model was "
                   f"trained on ({seen[0]['as']}): its perplexity is not a held-out number", err=True)


def summary(p: PerplexityResult) -> list[str]:
    if p.kind != "causal_lm":
        how = (f"input {p.context} tokens, seed {p.spans.seed}" if p.spans else f"inputs up to {p.context} tokens")
        return [f"{p.kind.replace('_', '-')} perplexity {p.token_perplexity:.4g} of the targets ({how}, "
                f"{p.tokens} target tokens in {p.examples} examples)"
                + (f", bits/byte {p.bits_per_byte:.4f}, word ppl {p.word_perplexity:.4g}" if p.bits_per_byte else "")]
    return [f"perplexity {p.token_perplexity:.4g} (context {p.context}, stride {p.stride}, "
            f"{p.tokens} tokens), bits/byte {p.bits_per_byte:.4f}, word ppl {p.word_perplexity:.4g}"]


def inputs(s: Any) -> list[tuple[str, Any]]:
    return [("data file", s.data.file)] if s.data.file is not None else []


PERPLEXITY = register(Measurement(
    name="perplexity", heading="Perplexity", asked_by="--data (perplexity)", flags=PerplexityFlags,
    settings=settings, record=PerplexityResult, run=run, prepare=prepare, inputs=inputs, summary=summary, done=warn_seen, builtin=True))
