"""`gqakit eval` and `gqakit compare`: thin click layers over runner.py and report.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from gqakit.core import trust
from gqakit.core.clihelp import GroupedCommand
from gqakit.core.errors import GqakitError
from gqakit.eval.measurement import IO_HEADING, flag_fields
from gqakit.eval.measures import measurements, settings_from

if TYPE_CHECKING:
    from gqakit.eval.results import EvalResult

# `gqakit eval --help`: the options of inputs and outputs first, then each measurement's
# under its heading (eval/measurement.py), then the device and the run
RUN_GROUP = ("Device and run", ("device", "dtype", "quiet", "trust_remote_code", "help"))


def eval_option_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(heading, option names) of `gqakit eval --help`, from the registered measurements."""
    groups: dict[str, list[str]] = {IO_HEADING: []}
    for m in measurements().values():
        for name, f in flag_fields(m):
            groups.setdefault(f.json_schema_extra["cli"]["group"] or m.heading, []).append(name)  # type: ignore[index]
    groups[IO_HEADING] += ["out", "overwrite"]
    return (*((t, tuple(n)) for t, n in groups.items()), RUN_GROUP)


def _option(name: str, f: Any) -> Callable[[Any], Any]:
    cli = {k: v for k, v in f.json_schema_extra["cli"].items() if k not in ("lead", "group")}
    decls = cli.pop("decls")
    return click.option(*decls, name, default=f.default, help=f.description, **cli)


def measurement_options(lead: bool) -> list[Callable[[Any], Any]]:
    """The click options of every registered measurement's flags (`lead`: the options that ask
    for one, which come first), in registry and field order."""
    return [_option(n, f) for m in measurements().values() for n, f in flag_fields(m)
            if bool(f.json_schema_extra["cli"]["lead"]) == lead]


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


def make_eval_command() -> click.Command:
    """`gqakit eval`, its options generated from the registered measurements' flags: a
    measurement registered before this call has its options in the command it returns."""
    options = [*measurement_options(lead=True),
               click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
                            help="Results JSON to write."),
               *measurement_options(lead=False),
               click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, or auto."),
               click.option("--dtype", default="auto", show_default=True,
                            help="float32, bfloat16, float16, or auto (fp32 CPU, bf16 GPU)."),
               click.option("--overwrite", is_flag=True,
                            help="Replace --out when it is an earlier gqakit results file."),
               click.option("-q", "--quiet", is_flag=True,
                            help="Nothing on stderr but errors (no bars or library warnings); on stdout the numbers only, no 'wrote' line."),
               trust.option("; for the task files of --tasks-path, the Python modules their `!function` tags "
                            "import and their Jinja templates outside Jinja's sandbox")]

    def eval_cmd(model: str, out: Path, device: str, dtype: str, overwrite: bool, quiet: bool,
                 **values: Any) -> None:
        from gqakit.eval.runner import run_eval

        ctx = click.get_current_context()
        given = {k for k in values if ctx.get_parameter_source(k) != ParameterSource.DEFAULT}
        res = run_eval(model, measures=eval_settings(values, given), device=device, dtype=dtype, out=out,
                       command=command_line(), progress=not quiet, overwrite=overwrite, quiet=quiet)
        print_summary(res, out, quiet=quiet)
        from gqakit.eval.measures.serving import verdict

        verdict(res)  # a failed serving check: exit 1, its results written

    eval_cmd.__doc__ = EVAL_HELP
    fn: Any = eval_cmd
    for option in reversed(options):
        fn = option(fn)
    fn = click.argument("model")(fn)
    return click.command("eval", cls=GroupedCommand, option_groups=eval_option_groups(),
                         context_settings={"help_option_names": ["-h", "--help"]})(fn)


EVAL_HELP = """Measure perplexity, decode speed and task accuracy of MODEL (a folder, a .gguf file, or a Hub id
org/name[@revision] in the Hugging Face cache, recorded by that id).

Perplexity is token-level over a sliding window (--context, --stride), plus bits per
byte and word/byte perplexity, which compare models with different tokenizers.
Speed times prefill and per-token decode with a static KV cache over the grid
--batch x --prompt-len (an encoder-decoder: --batch x --input-len x --output-len, the
encoder once per point), and reports KV-cache bytes, peak memory and the achieved
fraction of the device's copy bandwidth; --engine picks what runs the steps (gqakit's own
runtime, stock transformers, vLLM or llama.cpp; docs/serving.md). --check runs the serving
check alone on --engine: its greedy tokens against transformers and its KV cache against
gqakit's prediction, PASS or FAIL. --tasks runs lm-evaluation-harness tasks
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
  gqakit eval ./my-gqa --speed --engine transformers --batch 1,8 --prompt-len 1024 --out hf.json
  gqakit eval ./my-gqa --engine vllm --check --out check.json
  gqakit eval ./t5-gqa --speed --batch 1,8 --input-len 512,4096 --output-len 1,128 --out t5.json
  gqakit eval ./my-gqa --data hf:wikitext:wikitext-2-raw-v1:test --speed --max-batch-search --out all.json
  gqakit eval ./my-gqa --tasks hellaswag,arc_easy --num-fewshot 0 --out acc.json
  gqakit eval ./my-gqa --tasks gqakit_stories_mc --tasks-path examples/tasks --limit 20 --out acc.json
  gqakit eval ./t5-g2 --data valid.txt --context 512 --span-seed 0 --out t5.json
  gqakit eval ./bart-g2 --data pairs.jsonl --objective paired --context 1024 --out bart.json
"""

eval_cmd = make_eval_command()
EVAL_OPTION_GROUPS = eval_option_groups()  # the `--help` headings of `eval_cmd`


def eval_settings(values: dict[str, Any], given: set[str] | None = None) -> dict[str, Any]:
    """{name: settings} of each measurement `gqakit eval` was asked for, from its options'
    values (`given`: the options the user set, default all in `values`; the others keep their
    defaults, and a grid axis not given is not refused for the other kind of model). Each
    checked when built. `gqakit.evaluate` builds them here too."""
    return settings_from(values, set(values) if given is None else given)


def print_summary(res: EvalResult, out: Path, *, quiet: bool = False) -> None:
    """What `gqakit eval` prints: each measurement's summary lines (the numbers asked for, also
    with -q), then the file written (not with -q)."""
    for name, m in measurements().items():
        block = res.block(name)
        if block and m.summary is not None:
            for line in m.summary(block):
                click.echo(line)
    if not quiet:
        click.echo(f"wrote {out}")


@click.command("compare", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Report folder to write.")
@click.option("--names", help="Comma-separated row names (default: model folder names).")
@click.option("--train-log", type=click.Path(path_type=Path), help="Uptraining log to plot: uptrain's log.jsonl, its run folder, or a CSV with step and loss.")
@click.option("--overwrite", is_flag=True, help="Replace --out when it is an earlier gqakit report (never its inputs).")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (the warnings stay in report.md), no 'wrote' line.")
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
    if not quiet:
        click.echo(f"wrote {out / 'report.md'}, {out / 'report.json'} and {len(md['plots'])} plots")
