"""The serving check (`gqakit eval MODEL --engine ENGINE --check`), as registered with
`gqakit eval`: the engine generates greedily, the loaded transformers model scores its tokens
teacher-forced, and the engine's KV allocation is held against gqakit's prediction
(`gqakit.engines.check`). Its block is `serving` in the results file; a FAIL exits 1 once the
results are written (`verdict`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from gqakit.core.errors import GqakitError
from gqakit.eval.measurement import Context, Flags, Measurement, flag, register
from gqakit.eval.records import UNSET, AsGiven, Record


class ServingFlags(Flags):
    check: Any = flag("--check", default=False, is_flag=True, lead=True, group="Engine",
                      help="Run the serving check alone on --engine: greedy tokens against transformers "
                           "teacher-forced (>= 99% agreement, every mismatch a near-tie) and the engine's KV bytes "
                           "per token against gqakit's prediction; prints PASS or FAIL, exits 1 on FAIL.")
    check_prompts: Any = flag("--check-prompts", default=4, show_default=True, type=int, group="Engine",
                              help="Prompts of the serving check.")
    check_tokens: Any = flag("--check-tokens", default=16, show_default=True, type=int, group="Engine",
                             help="Greedy tokens per prompt in the serving check.")
    check_prompt_len: Any = flag("--check-prompt-len", default=24, show_default=True, type=int, group="Engine",
                                 help="Tokens per prompt in the serving check.")
    # the speed measurement's options, read here (they are declared there)
    engine: Any = None
    speed: Any = None


class ServingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = "gqakit"
    prompts: int = 4
    new_tokens: int = 16
    prompt_len: int = 24


def settings(f: ServingFlags) -> ServingSettings | None:
    given = f.model_fields_set
    if not f.check:
        if given & {"check_prompts", "check_tokens", "check_prompt_len"}:
            raise GqakitError("--check-prompts, --check-tokens and --check-prompt-len go with --check")
        if "engine" in given and not f.speed:
            raise GqakitError("--engine goes with --speed or --check")
        return None
    if f.speed:
        raise GqakitError("--check runs the serving check alone; time the engine in another run with --speed")
    vals = [f.check_prompts, f.check_tokens, f.check_prompt_len]
    if any(not isinstance(v, int) or v < 1 for v in vals):
        raise GqakitError("--check-prompts, --check-tokens and --check-prompt-len must be at least 1")
    return ServingSettings(engine=f.engine or "gqakit", prompts=f.check_prompts, new_tokens=f.check_tokens,
                           prompt_len=f.check_prompt_len)


class ServingResult(Record):
    """The `serving` block: `gqakit.engines.check.ServingCheck` as the results file keeps it."""

    engine: StrictStr
    model: StrictStr
    prompts: StrictInt
    new_tokens: StrictInt
    prompt_source: StrictStr = UNSET
    positions: StrictInt
    agreement: StrictFloat | StrictInt
    margin_row: StrictStr
    margin: StrictFloat | StrictInt
    mismatches: AsGiven[list[dict[str, Any]]]
    unexplained: StrictInt
    max_abs_logprob_diff: StrictFloat | StrictInt | None = None
    kv: AsGiven[dict[str, Any]]
    rule: StrictStr
    passed: StrictBool




def check(s: ServingSettings, model_path: Any, encoder_decoder: bool) -> None:
    from gqakit.engines import get_engine

    if encoder_decoder:
        raise GqakitError("--check: the serving check runs decoder-only models (an encoder-decoder's engines: "
                          "docs/serving.md)")
    get_engine(s.engine)  # an engine that is not installed: one line, before the model loads


def run(ctx: Context, s: ServingSettings, prepared: Any) -> ServingResult:
    from gqakit.core.loading import load_tokenizer, split_source
    from gqakit.engines import EngineOptions, get_engine
    from gqakit.engines.check import kv_budget_for, make_prompts, run_check

    folder, gguf = split_source(ctx.model_path)
    try:
        tokenizer = load_tokenizer(ctx.model_path)
    except GqakitError:
        tokenizer = None
    vocab = int(ctx.model.config.get_text_config(decoder=True).vocab_size)
    prompts, source = make_prompts(s.prompts, s.prompt_len, vocab, tokenizer)
    dtype = str(ctx.dtype).removeprefix("torch.")
    engine = get_engine(s.engine)
    # a GGUF computes in its own tensor types, and llama.cpp sizes its cache by the context; a
    # folder gets a KV budget of its own, which keeps vLLM from reserving most of the machine's
    # memory (its default) for a check of a few short sequences
    engine.load(folder, EngineOptions(dtype="auto" if gguf else dtype, max_len=s.prompt_len + s.new_tokens,
                                      max_batch=s.prompts, gguf_file=gguf,
                                      kv_budget_bytes=None if gguf else kv_budget_for(ctx.model.config, s.prompts + 1,
                                                                                      s.prompt_len + s.new_tokens)))
    try:
        # the gqakit and transformers engines compute on transformers' own dequantised weights, as the
        # teacher does; another engine on a GGUF computes on the quantised ones
        quant = None if s.engine in ("gqakit", "transformers") else gguf_quant(folder, gguf)
        result = run_check(ctx.model_path, engine, ctx.model, dtype=dtype, prompts=prompts, new_tokens=s.new_tokens,
                           prompt_source=source, quant=quant)
    finally:
        engine.close()
    return ServingResult.model_validate(result.model_dump())


def gguf_quant(folder: Any, gguf: str | None) -> str | None:
    """The coarsest matmul weight type of a GGUF (`gqakit.engines.check.gguf_quant`), for the margin."""
    if not gguf:
        return None
    from gqakit.engines.check import gguf_quant as coarsest

    try:
        from gguf import GGUFReader

        return coarsest(t.tensor_type.name for t in GGUFReader(str(folder / gguf)).tensors if len(t.shape) > 1)
    except Exception:  # an unreadable type: the quantised margin applies
        return "unknown"


def summary(b: ServingResult) -> list[str]:
    from gqakit.engines.check import ServingCheck, table

    return table(ServingCheck.model_validate({k: v for k, v in b.to_json().items()
                                              if k in ServingCheck.model_fields}))


def verdict(results: Any) -> None:
    """After the results are written: a failed serving check ends the command with exit 1."""
    from gqakit.engines.check import CheckFailed

    b = results.block("serving")
    if b is not UNSET and b is not None and not b.passed:
        raise CheckFailed(f"the {b.engine} engine does not serve {b.model} as transformers computes it "
                          f"({100 * b.agreement:.2f}% agreement, {b.unexplained} unexplained mismatches, KV "
                          f"{'as predicted' if b.kv.get('match') else 'not as predicted'}); see the table above")


SERVING = register(Measurement(
    name="serving", heading="Engine", asked_by="--check", flags=ServingFlags, settings=settings,
    record=ServingResult, run=run, check=check, summary=summary))
