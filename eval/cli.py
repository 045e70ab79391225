"""`gqakit eval` and `gqakit compare`: thin click layers over runner.py and report.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from gqakit.core import trust
from gqakit.core.clihelp import GroupedCommand
from gqakit.core.errors import GqakitError
from gqakit.eval.records import OBJECTIVES, UNSET

if TYPE_CHECKING:
    from gqakit.eval.records import EvalResult

# `gqakit eval --help`: its options under these headings, in this order
EVAL_OPTION_GROUPS = (
    ("Input and output", ("data", "max_chars", "text_field", "out", "overwrite")),
    ("Perplexity", ("ppl", "context", "stride", "objective", "span_seed", "input_field", "target_field")),
    ("Decode speed", ("speed", "batches", "prompt_lens", "input_lens", "output_lens", "new_tokens", "reps", "warmup",
                      "compile_", "eager", "prefill_once", "max_batch_search", "max_batch_limit")),
    ("Tasks (lm-evaluation-harness)", ("tasks", "num_fewshot", "limit", "tasks_path", "tasks_batch")),
    ("Device and run", ("device", "dtype", "quiet", "trust_remote_code", "help")),
)


def command_line() -> list[str]:
    """The command as a user would retype it, rebuilt from click's parsed parameters.

    sys.argv is wrong when gqakit runs in-process (tests, the demo); the parsed
    parameters are right in every case. Options left at their default are omitted.
    """
    ctx = click.get_current_context()
    words = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            words += [str(v) for v in (value if isinstance(value, (tuple, list)) else [value])]
        elif value is not None and value != param.default and not (getattr(param, "is_flag", False) and value is False
                                                                     and not param.secondary_opts):
            flag = param.opts[-1] if len(param.opts) else f"--{param.name}"
            if param.is_flag:
                if value is True:
                    words.append(flag)
                elif param.secondary_opts:
                    words.append(param.secondary_opts[-1])
            else:
                words += [flag, str(value)]
    return words


@click.command("eval", cls=GroupedCommand, option_groups=EVAL_OPTION_GROUPS,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--data", help="Text file, or hf:NAME[:CONFIG][:SPLIT] from the local datasets cache.")
@click.option("--ppl/--no-ppl", default=None, help="Measure perplexity (default: on when --data is given).")
@click.option("--speed", is_flag=True, help="Measure prefill and decode speed over the batch x prompt grid.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Results JSON to write.")
@click.option("--context", default=512, show_default=True, help="Perplexity window, in tokens.")
@click.option("--stride", type=int, default=None, help="Window step, in tokens (default: --context).")
@click.option("--max-chars", type=int, default=None, help="Use only the first N characters of the data.")
@click.option("--text-field", default="text", show_default=True, help="Column of an hf: dataset.")
@click.option("--objective", type=click.Choice(list(OBJECTIVES)), default=None,
              help="Perplexity of what (default: by the model): causal_lm (a decoder: each token given the ones "
                   "before it); for an encoder-decoder, of the target tokens given the input: span_corruption "
                   "(--data is plain text, corrupted as T5 pre-trains, inputs of --context tokens) or paired "
                   "(--data is JSONL of input/target objects, inputs cut to --context tokens).")
@click.option("--span-seed", default=0, show_default=True, help="Seed of span_corruption's spans (recorded).")
@click.option("--input-field", default="input", show_default=True, help="Input field of --objective paired data.")
@click.option("--target-field", default="target", show_default=True, help="Target field of --objective paired data.")
@click.option("--batch", "batches", default="1,8,32", show_default=True, help="Batch sizes of the speed grid.")
@click.option("--prompt-len", "prompt_lens", default="128,1024", show_default=True, help="Prompt lengths of the grid.")
@click.option("--input-len", "input_lens", default=None,
              help="Encoder-decoders: input lengths of the grid, which is --batch x --input-len x --output-len "
                   "[default: 512,2048].")
@click.option("--output-len", "output_lens", default=None,
              help="Encoder-decoders: output tokens already in the self-attention cache when the timed steps "
                   "start (1: right after the start token) [default: 1].")
@click.option("--new-tokens", default=128, show_default=True, help="Decode steps timed per run.")
@click.option("--reps", default=5, show_default=True, help="Timed repetitions per grid point (median, p90).")
@click.option("--warmup", default=2, show_default=True, help="Untimed warm-up runs per grid point.")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the decode step (CPU: weights frozen; needs a C++ compiler, ~1 min per model and grid point). "
                   "The fastest CPU path; compile time is reported apart.")
@click.option("--eager", is_flag=True,
              help="Plain transformers decode steps: no CUDA graphs, no packed CPU weights, SDPA attention "
                   "(the fallback; default is the fast path, see docs/decode.md).")
@click.option("--prefill-once", is_flag=True,
              help="Time prefill once per grid point; decode repetitions rewind the cache to the prompt.")
@click.option("--max-batch-search", is_flag=True, help="Find the largest batch that fits at each prompt length.")
@click.option("--max-batch-limit", default=4096, show_default=True, help="Stop the max-batch search here.")
@click.option("--tasks", "tasks", help="lm-evaluation-harness tasks, comma-separated (needs gqakit[tasks]).")
@click.option("--num-fewshot", type=int, default=None, help="Few-shot examples per task (default: each task's own).")
@click.option("--limit", type=int, default=None, help="Use only the first N examples of each task (quick checks).")
@click.option("--tasks-path", type=click.Path(path_type=Path), default=None,
              help="Folder of local task YAML files (over local data files), added to the harness's tasks.")
@click.option("--tasks-batch", default=1, show_default=True, help="Batch size of the task requests.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, or auto.")
@click.option("--dtype", default="auto", show_default=True, help="float32, bfloat16, float16, or auto (fp32 CPU, bf16 GPU).")
@click.option("--overwrite", is_flag=True, help="Replace --out when it is an earlier gqakit results file.")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (no bars or library warnings).")
@trust.option("; for the task files of --tasks-path, the Python modules their `!function` tags import and "
              "their Jinja templates outside Jinja's sandbox")
def eval_cmd(model, data, ppl, speed, out, context, stride, max_chars, text_field, objective, span_seed, input_field,
             target_field, batches, prompt_lens, input_lens, output_lens, new_tokens, reps, warmup, compile_, eager,
             prefill_once, max_batch_search, max_batch_limit, tasks, num_fewshot, limit, tasks_path, tasks_batch,
             device, dtype, overwrite, quiet) -> None:
    """Measure perplexity, decode speed and task accuracy of MODEL (a folder, a .gguf file, or a Hub id
    org/name[@revision] in the Hugging Face cache, recorded by that id).

    Perplexity is token-level over a sliding window (--context, --stride), plus bits per
    byte and word/byte perplexity, which compare models with different tokenizers.
    Speed times prefill and per-token decode with a static KV cache over the grid
    --batch x --prompt-len (an encoder-decoder: --batch x --input-len x --output-len, the
    encoder once per point), and reports KV-cache bytes, peak memory and the achieved
    fraction of the device's copy bandwidth. --tasks runs lm-evaluation-harness tasks
    (accuracy with its standard error) on the same loaded model; --tasks-path adds local
    task YAML files. Datasets are read from local files or the local datasets cache, never
    the Hub. An encoder-decoder (T5, mT5, BART) is scored on its target tokens given the input:
    span corruption of plain text (seeded) or paired input/target data (--objective).

    \b
    Examples:
      gqakit eval ./stories-g2 --data valid.txt --out g2.json
      gqakit eval ./stories-g2 --data valid.txt --context 512 --stride 256 --out g2.json
      gqakit eval ./my-gqa --speed --batch 1,8,32 --prompt-len 128,1024 --new-tokens 128 --out s.json
      gqakit eval ./my-gqa --speed --batch 8 --prompt-len 1024 --prefill-once --eager --out eager.json
      gqakit eval ./t5-gqa --speed --batch 1,8 --input-len 512,4096 --output-len 1,128 --out t5.json
      gqakit eval ./my-gqa --data hf:wikitext:wikitext-2-raw-v1:test --speed --max-batch-search --out all.json
      gqakit eval ./my-gqa --tasks hellaswag,arc_easy --num-fewshot 0 --out acc.json
      gqakit eval ./my-gqa --tasks gqakit_stories_mc --tasks-path examples/tasks --limit 20 --out acc.json
      gqakit eval ./t5-g2 --data valid.txt --context 512 --span-seed 0 --out t5.json
      gqakit eval ./bart-g2 --data pairs.jsonl --objective paired --context 1024 --out bart.json
    """
    from gqakit.eval.runner import run_eval

    given = click.get_current_context().get_parameter_source("prompt_lens") != ParameterSource.DEFAULT
    ppl_settings, speed_settings, task_settings = eval_settings(
        data=data, ppl=ppl, speed=speed, context=context, stride=stride, max_chars=max_chars, text_field=text_field,
        objective=objective, span_seed=span_seed, input_field=input_field, target_field=target_field,
        batches=batches, prompt_lens=prompt_lens if given else None, input_lens=input_lens, output_lens=output_lens,
        new_tokens=new_tokens, reps=reps, warmup=warmup, compile_=compile_, eager=eager, prefill_once=prefill_once,
        max_batch_search=max_batch_search, max_batch_limit=max_batch_limit, tasks=tasks, num_fewshot=num_fewshot,
        limit=limit, tasks_path=tasks_path, tasks_batch=tasks_batch)
    res = run_eval(model, perplexity=ppl_settings, speed=speed_settings, tasks=task_settings, device=device,
                   dtype=dtype, out=out, command=command_line(), progress=not quiet, overwrite=overwrite, quiet=quiet)
    _print_summary(res, out)


def eval_settings(*, data, ppl, speed, context, stride, max_chars, text_field, objective, span_seed, input_field,
                  target_field, batches, prompt_lens, input_lens, output_lens, new_tokens, reps, warmup, compile_,
                  eager, prefill_once, max_batch_search, max_batch_limit, tasks, num_fewshot, limit, tasks_path,
                  tasks_batch) -> tuple[Any, Any, Any]:
    """The settings of each measurement `gqakit eval` was asked for, from its options (None for
    one not asked for): (PerplexitySettings, SpeedSettings, TaskSettings), each checked when
    built. `prompt_lens` is None when not given (an axis for the other kind of model is refused).
    `gqakit.evaluate` builds them here too."""
    from gqakit.eval.perplexity import PerplexitySettings, Spans, Window
    from gqakit.eval.speed import SpeedSettings

    ppl = bool(data) if ppl is None else ppl
    task_settings = None
    if tasks is not None:
        from gqakit.eval.tasks import TaskSettings, parse_tasks

        task_settings = TaskSettings(tasks=parse_tasks(tasks), num_fewshot=num_fewshot, limit=limit,
                                     tasks_path=tasks_path, batch_size=tasks_batch)
    elif num_fewshot is not None or limit is not None or tasks_path is not None:
        raise GqakitError("--num-fewshot, --limit and --tasks-path go with --tasks NAMES")
    speed_settings = None
    if speed:
        # the grid axes the command line named (an axis for the other kind of model is refused)
        axes = {k: v for k, v in (("prompt_lens", prompt_lens), ("input_lens", input_lens),
                                  ("output_lens", output_lens)) if v is not None}
        speed_settings = SpeedSettings(batches=batches, **axes,
                                       new_tokens=new_tokens, reps=reps, warmup=warmup, compile=compile_,
                                       max_batch_search=max_batch_search, max_batch_limit=max_batch_limit,
                                       eager=eager, prefill_once=prefill_once)
    ppl_settings = None
    if ppl:
        if not data:
            raise GqakitError("--ppl needs --data FILE (or hf:NAME[:CONFIG][:SPLIT])")
        ppl_settings = PerplexitySettings(data=data, window=Window(context=context, stride=stride),
                                          max_chars=max_chars, text_field=text_field, objective=objective,
                                          spans=Spans(seed=span_seed), input_field=input_field,
                                          target_field=target_field)
    elif objective is not None:
        raise GqakitError("--objective goes with --data (perplexity)")
    return ppl_settings, speed_settings, task_settings


def _print_summary(res: EvalResult, out: Path) -> None:
    if res.perplexity and res.perplexity.kind != "causal_lm":
        p = res.perplexity
        how = (f"input {p.context} tokens, seed {p.spans.seed}" if p.spans else f"inputs up to {p.context} tokens")
        click.echo(f"{p.kind.replace('_', '-')} perplexity {p.token_perplexity:.4g} of the targets ({how}, "
                   f"{p.tokens} target tokens in {p.examples} examples)"
                   + (f", bits/byte {p.bits_per_byte:.4f}, word ppl {p.word_perplexity:.4g}" if p.bits_per_byte else ""))
    elif res.perplexity:
        p = res.perplexity
        click.echo(f"perplexity {p.token_perplexity:.4g} (context {p.context}, stride {p.stride}, "
                   f"{p.tokens} tokens), bits/byte {p.bits_per_byte:.4f}, word ppl {p.word_perplexity:.4g}")
    if res.speed:
        s = res.speed
        click.echo(f"attention: {s.attention['implementation']}, {s.attention['decode_path']}")
        if s.graph_error:
            click.echo(f"  CUDA graphs failed, decode steps ran eagerly: {s.graph_error}")
        for g in s.grid:
            where = (f"  batch {g.batch:>4} prompt {g.prompt_len:>5}" if g.output_len is UNSET else
                     f"  batch {g.batch:>4} input {g.prompt_len:>5} output {g.output_len:>4}")
            if g.ok:
                click.echo(f"{where}: prefill {g.prefill_ms['median']:.1f} ms, "
                           f"decode {g.decode_ms_per_token['median']:.2f} ms/step, {g.tokens_per_s['median']:.1f} tok/s, "
                           f"{100 * g.roofline_fraction:.1f}% of copy bandwidth ({g.decode_mode}"
                           f"{', weights packed' if g.packed_weight_bytes else ''})")
            else:
                click.echo(f"{where}: out of memory ({g.reason})")
        for m in s.max_batch:
            click.echo(f"  max batch at prompt {m.prompt_len}: {m.max_batch}{'+' if m.at_limit else ''} ({m.method})")
    if res.tasks:
        t = res.tasks
        click.echo(f"tasks (lm-evaluation-harness {t.harness_version}):")
        for name, row in t.rows().items():
            n = row.examples
            metrics = ", ".join(f"{m} {v.value:.4f}" + (f" ± {v.stderr:.4f}" if v.stderr is not None else "")
                                for m, v in row.metrics.items())
            click.echo(f"  {name}{f' ({n} examples)' if n else ''}: {metrics}")
    click.echo(f"wrote {out}")


@click.command("compare", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Report folder to write.")
@click.option("--names", help="Comma-separated row names (default: model folder names).")
@click.option("--train-log", type=click.Path(path_type=Path), help="Uptraining log to plot: uptrain's log.jsonl, its run folder, or a CSV with step and loss.")
@click.option("--overwrite", is_flag=True, help="Replace --out when it is an earlier gqakit report (never its inputs).")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (the warnings stay in report.md).")
def compare_cmd(results, out, names, train_log, overwrite, quiet) -> None:
    """Put several `gqakit eval` results side by side; the first is the baseline.

    Writes report.md (one row per model: method and G, parameters, KV heads, KV cache per
    token and its dtype, perplexity and its change against the first, bits per byte, decode
    tokens/s and speedup at each grid point, largest batch; then each grid point's spread
    over the repetitions, with speedups the repetitions do not separate from 1x marked
    "within noise"), report.json with the same content, and PNG plots (uptrain_loss.png:
    training and held-out loss on separate axes).

    \b
    Examples:
      gqakit compare mha.json gqa.json --out report/
      gqakit compare orig.json conv.json up.json --names original,converted,uptrained --out report/
      gqakit compare orig.json up.json --train-log ./uptrain-run/log.jsonl --out report/ --overwrite
    """
    from gqakit.eval.report import write_report

    if len(results) < 1:
        raise GqakitError("give at least one results file")
    name_list = [n.strip() for n in names.split(",")] if names else None
    from gqakit.core.quiet import quiet_libraries

    with quiet_libraries(quiet, hf=False):
        md = write_report(list(results), out, names=name_list, train_log=train_log, overwrite=overwrite,
                          command=command_line())
    for w in [] if quiet else md.get("warnings", []):
        click.echo(f"gqakit: warning: {w}", err=True)
    click.echo(f"wrote {out / 'report.md'}, {out / 'report.json'} and {len(md['plots'])} plots")
