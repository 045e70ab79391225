"""`gqakit uptrain CONFIG.yaml [section.key=value ...]`."""

from __future__ import annotations

import click

from gqakit.core import trust
from gqakit.core.errors import GqakitError


@click.command("uptrain", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--overwrite", is_flag=True,
              help="Replace output.dir when it holds an earlier gqakit run (only after every check has passed).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in output.dir/checkpoints.")
@click.option("--dry-run", is_flag=True, help=("Validate the config, print it resolved with the memory plan (peak device "
                                                "memory per process, by part; no weights are loaded), and stop."))
@click.option("--device-memory", "device_memory", multiple=True, metavar="SIZE",
              help="With --dry-run: plan for a GPU of this memory (80GB, 24GiB; repeatable). Default: this machine's.")
@click.option("--accelerate-config", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --dry-run: plan for the processes and sharding (DDP, FSDP) of this accelerate config.")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (no bars, plan or library warnings).")
@trust.option(" (model.path and teacher.path). A config file cannot give this consent")
def uptrain_cmd(config: str, overrides: tuple[str, ...], overwrite: bool, resume: bool, dry_run: bool,
                device_memory: tuple[str, ...], accelerate_config: str | None, quiet: bool) -> None:
    """Continue pre-training a converted (GQA) model, driven by a YAML CONFIG.

    OVERRIDES are dotted `section.key=value` pairs (values are YAML); an unknown key
    is an error. The run folder `output.dir` holds `checkpoints/step-N/`, `log.jsonl`,
    the tensorboard logs in `uptrain/` (`tensorboard --logdir output.dir`; when
    tensorboard is installed and logging.tensorboard is true), the resolved
    `gqakit_uptrain.yaml`, and at the end the final model in `model/`, loadable like
    any `gqakit convert` output.

    Every input (model, teacher, data files, eval file, sizes) is checked before
    anything is written; --overwrite deletes an earlier run only after that, and only
    a run gqakit wrote. Ctrl-C prints the command that resumes the run.

    \b
    Examples:
      gqakit uptrain configs/tiny-cpu.yaml model.path=/tmp/tiny-g2 output.dir=/tmp/run
      gqakit uptrain configs/stories260K-g2.yaml train.tokens=500000 train.seed=1
      gqakit uptrain configs/stories260K-g2.yaml --resume
      gqakit uptrain configs/smollm2-135M-g1.yaml --dry-run --device-memory 24GB --device-memory 80GB
      gqakit uptrain configs/smollm2-135M-g1.yaml --dry-run --accelerate-config configs/accelerate/fsdp.yaml
      accelerate launch --config_file configs/accelerate/ddp.yaml -m gqakit uptrain configs/smollm2-135M-g1.yaml
      accelerate launch --multi_gpu --num_processes 2 -m gqakit uptrain configs/tiny-cpu.yaml train.grad_accum=1  # CPU: gloo
    """
    if (device_memory or accelerate_config) and not dry_run:
        raise GqakitError("--device-memory and --accelerate-config plan a run: add --dry-run")
    if dry_run:
        _dry_run(config, overrides, device_memory, accelerate_config)
        return
    # Cheap checks first (config, paths, sizes, the run folder): no torch import yet.
    from gqakit.uptrain.preflight import preflight

    checked = preflight(config, overrides, overwrite=overwrite, resume=resume)
    from gqakit.uptrain.trainer import run_checked

    run_checked(checked, quiet=quiet)


def _dry_run(config: str, overrides: tuple[str, ...], device_memory: tuple[str, ...],
             accelerate_config: str | None) -> None:
    """The resolved config, then the memory plan as YAML comments (the output stays valid YAML).
    Writes nothing and loads no weights: the model is counted from its config.json."""
    from gqakit.core.hub import resolve_model_ref
    from gqakit.uptrain.config import load_config, to_yaml
    from gqakit.uptrain.plan import parse_size

    cfg = load_config(config, overrides)
    for m in device_memory:
        parse_size(m)  # a bad size is one line before anything is printed
    click.echo(to_yaml(cfg), nl=False)
    if not (resolve_model_ref(cfg.model.path).path / "config.json").is_file():  # a Hub id: its cached snapshot
        click.echo(f"# memory plan: none; model.path {cfg.model.path} has no config.json")
        return
    from gqakit.uptrain.plan import plan_for_config

    lines, fits = plan_for_config(cfg, device_memory=device_memory, accelerate_config=accelerate_config)
    click.echo("\n".join("# " + ln for ln in lines))
    if not fits:
        raise GqakitError("the plan does not fit any device named; " + lines[-1].split("; ", 1)[-1])
