"""`gqakit uptrain CONFIG [section.key=value ...]`; `gqakit uptrain --list-configs`."""

from __future__ import annotations

import click

from gqakit.core import trust
from gqakit.core.errors import GqakitError


@click.command("uptrain", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", required=False, metavar="CONFIG")
@click.argument("overrides", nargs=-1)
@click.option("--list-configs", is_flag=True, help="List the shipped configs by name, with what each does, and stop.")
@click.option("--overwrite", is_flag=True,
              help="Replace output.dir when it holds an earlier gqakit run (only after every check has passed).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in output.dir/checkpoints.")
@click.option("--dry-run", is_flag=True, help=(
    "Make every check a run makes before its first step (paths, tokenizer, schedule against the budget, "
    "memory plan), print the resolved config, the schedule and the memory plan (peak device memory per process, "
    "by part; no weights are loaded), report every problem, and stop; exit status 0 only if the run would start."))
@click.option("--device-memory", "device_memory", multiple=True, metavar="SIZE",
              help="With --dry-run: plan for a GPU of this memory (80GB, 24GiB; repeatable). Default: this machine's.")
@click.option("--accelerate-config", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --dry-run: plan for the processes and sharding (DDP, FSDP) of this accelerate config.")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (no bars, plan or library warnings).")
@trust.option(" (model.path and teacher.path). A config file cannot give this consent")
def uptrain_cmd(config: str | None, overrides: tuple[str, ...], list_configs: bool, overwrite: bool, resume: bool,
                dry_run: bool, device_memory: tuple[str, ...], accelerate_config: str | None, quiet: bool) -> None:
    """Continue pre-training a converted (GQA) model, driven by a YAML CONFIG.

    CONFIG is a YAML file, or the name of a config shipped with gqakit
    (`gqakit uptrain --list-configs`), usable from any folder. OVERRIDES are dotted
    `section.key=value` pairs (values are YAML); an unknown key is an error. A shipped
    config leaves out what only you know: model.path (the folder `gqakit convert`
    wrote) and, where its recipe needs them, teacher.path or data.files; every one
    still missing is named in one error line. Relative paths, in a file or an
    override, resolve against the working directory.

    The run folder `output.dir` holds `checkpoints/step-N/`, `log.jsonl`, the
    tensorboard logs in `uptrain/` (`tensorboard --logdir output.dir`; when
    tensorboard is installed and logging.tensorboard is true), the resolved
    `gqakit_uptrain.yaml`, and at the end the final model in `model/`, loadable like
    any `gqakit convert` output.

    Every input (model, teacher, data files, eval file, sizes) is checked before
    anything is written; --overwrite deletes an earlier run only after that, and only
    a run gqakit wrote. Ctrl-C prints the command that resumes the run.

    \b
    Examples:
      gqakit uptrain --list-configs
      gqakit uptrain stories260K-g2 model.path=s260k-g2 teacher.path=stories260K --dry-run
      gqakit uptrain stories260K-g2 model.path=s260k-g2 teacher.path=stories260K data.eval_file=valid.txt
      gqakit uptrain stories260K-g2 model.path=s260k-g2 teacher.path=stories260K --resume  # after Ctrl-C or a crash
      gqakit uptrain tiny-cpu model.path=tiny-g2 data.files=[input.txt] output.dir=tiny-run
      gqakit uptrain my-recipe.yaml train.tokens=2e6 train.seed=1
      gqakit uptrain smollm2-135M-g1 model.path=smol-g1 data.files=[wiki.txt] --dry-run --device-memory 24GB
      accelerate launch --config_file ddp.yaml -m gqakit uptrain smollm2-135M-g1 model.path=smol-g1 data.files=[wiki.txt]
    """
    if list_configs:
        _list_configs()
        return
    if config is None:
        raise click.UsageError("missing argument CONFIG (a YAML file, or a shipped config: gqakit uptrain --list-configs)")
    if (device_memory or accelerate_config) and not dry_run:
        raise GqakitError("--device-memory and --accelerate-config plan a run: add --dry-run")
    if dry_run:
        from gqakit.core.quiet import quiet_libraries
        from gqakit.uptrain.dryrun import dry_run as check_run, report

        with quiet_libraries(quiet):
            problems = check_run(config, overrides, device_memory=device_memory, accelerate_config=accelerate_config,
                                 resume=resume, overwrite=overwrite, echo=click.echo)
        report(problems, lambda line: click.echo(line, err=True))
        return
    # Cheap checks first (config, paths, sizes, the run folder): no torch import yet.
    from gqakit.uptrain.preflight import preflight

    checked = preflight(config, overrides, overwrite=overwrite, resume=resume)
    from gqakit.uptrain.trainer import run_checked

    run_checked(checked, quiet=quiet)


def _list_configs() -> None:
    from gqakit.uptrain.config import config_summary, packaged_configs

    shipped = packaged_configs()
    width = max((len(n) for n in shipped), default=0)
    for name, path in shipped.items():
        click.echo(f"{name:<{width}}  {config_summary(path)}".rstrip())
