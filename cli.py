"""The `gqakit` command line: one click group, one verb per job.

Each verb lives next to the code it drives (convert/cli.py, uptrain/cli.py, eval/cli.py)
and is imported lazily, so `gqakit --help` stays fast and a missing optional piece does
not break the other verbs.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

import gqakit
from gqakit.core.errors import GqakitError

# verb -> (module, attribute)
VERBS: dict[str, tuple[str, str]] = {
    "convert": ("gqakit.convert.cli", "convert_cmd"),
    "inspect": ("gqakit.convert.cli", "inspect_cmd"),
    "uptrain": ("gqakit.uptrain.cli", "uptrain_cmd"),
    "eval": ("gqakit.eval.cli", "eval_cmd"),
    "compare": ("gqakit.eval.cli", "compare_cmd"),
    "demo": ("gqakit.demo", "demo_cmd"),
}

SHORT_HELP = {
    "convert": "Convert an MHA/GQA model to fewer KV heads.",
    "inspect": "Show heads, parameters and KV-cache size for each possible G.",
    "uptrain": "Continue pre-training a converted model (accelerate).",
    "eval": "Measure perplexity, decode speed and task accuracy of a model.",
    "compare": "Put several eval results side by side (Markdown, JSON, plots).",
    "demo": "Convert, uptrain, evaluate and report SmolLM2-135M, offline.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in VERBS:
            return None
        module, attr = VERBS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(n, SHORT_HELP[n]) for n in VERBS])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(gqakit.__version__, prog_name="gqakit")
def cli() -> None:
    """Turn multi-head-attention language models into grouped-query-attention ones.

    \b
    Examples:
      gqakit inspect ./my-mha-model --context 4096 --batch 8
      gqakit convert ./my-mha-model ./my-gqa-model --num-kv-heads 4
      gqakit uptrain stories260K-g2 model.path=./my-gqa-model teacher.path=./my-mha-model
      gqakit eval ./my-gqa-model --data text.txt --ppl --speed --out gqa.json
      gqakit compare mha.json gqa.json --out report/
      gqakit demo
    """


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    try:
        cli.main(args=argv, prog_name="gqakit", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # A usage mistake is one line too, with where to look for the right usage.
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        click.echo(f"gqakit: error: {' '.join(e.format_message().split())}{hint}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except GqakitError as e:
        click.echo(f"gqakit: {e.label}: {e.one_line()}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("gqakit: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a bug, not a user error: still one line, traceback on request
        if os.environ.get("GQAKIT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        click.echo(f"gqakit: internal error: {type(e).__name__}: {first} (set GQAKIT_DEBUG=1 for the traceback)",
                   err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
