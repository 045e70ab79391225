"""The llama.cpp engine: a GGUF served in-process by llama.cpp through llama-cpp-python.

`load` opens a .gguf (a file, or a folder and `gguf_file`); a model folder without one is
refused with the command that writes it. `generate` is greedy on token ids: llama.cpp's own
decode (`Llama.eval`) and the argmax of its last logits, whose log-softmax is the logprob.
`time_point` is llama-bench's measurement at depth D = prompt_len: the prompt is processed in
batches of up to 512 tokens (prefill), then one token at a time (each step timed). llama-cpp-
python serves one sequence per context, so a batch above 1 is refused, not timed in turn.
`kv_allocation` reads the cache off llama.cpp itself (`llamacpp_kv`): the per-token bytes
from its state's K and V rows, the capacity from `llama_n_ctx` (n_ctx rounded up to 256).
"""

from __future__ import annotations

import collections
import ctypes
import math
import time
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from gqakit.core.errors import GqakitError
from gqakit.engines.base import EngineMissing, EngineOptions, Generation, KvAllocation, PointTiming
from gqakit.engines.llamacpp_kv import (gguf_geometry, gguf_step_weight_bytes, predicted_bytes_per_token,
                                        read_kv_state)

INSTALL = ("llama.cpp is not installed: run `bash scripts/engines.sh llama.cpp` or "
           "`pip install 'gqakit[llamacpp]'` (pip compiles llama.cpp: needs cmake and a C++ compiler)")
N_BATCH = 512  # llama-cpp-python's default batch: the prompt is decoded 512 tokens at a time


def import_llama_cpp() -> ModuleType:
    """The llama_cpp module, or EngineMissing saying how to install it. llama.cpp's log goes to
    `LOG` (kept for the error of a failed load) instead of stderr."""
    try:
        import llama_cpp
    except ImportError as e:  # also a wheel whose shared library does not load
        raise EngineMissing(f"{INSTALL} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None and hasattr(llama_cpp, "llama_log_set"):  # (a stand-in module has no log)
        # llama-cpp-python prints llama.cpp's log lines that it takes for errors to stderr, and its
        # table of ggml's log levels predates ggml's current order, so warnings (such as a context
        # longer than the model's training context) reach stderr even with verbose=False
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_keep_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    return llama_cpp


WARN, ERROR, CONT = 3, 4, 5  # ggml's log levels (debug 1 and info 2 are not kept)
LOG: collections.deque[tuple[int, str]] = collections.deque(maxlen=50)  # llama.cpp's latest warnings, errors
_LOG_CALLBACK: Any = None  # the ctypes callback llama.cpp holds: referenced here so it is never freed


def _keep_log(level: int, text: bytes, user_data: Any) -> None:
    if level == CONT and LOG:  # the rest of the line before
        LOG.append((LOG[-1][0], text.decode("utf-8", "replace")))
    elif level in (WARN, ERROR):
        LOG.append((level, text.decode("utf-8", "replace")))


def first_error() -> str:
    """The first error llama.cpp logged since `LOG` was cleared (its reason for a failure), or ''."""
    lines = "".join(t for lv, t in LOG if lv == ERROR).strip().splitlines()
    return lines[0].strip() if lines else ""


def _folder_source_hint(folder: Path) -> str:
    """How to get a GGUF of the model folder FOLDER: gqakit writes GGUF only from a GGUF source,
    so follow the conversion records back (through conversions that kept the head count, such as
    a GGUF read into a folder) to a .gguf, and name the conversion that writes the same model."""
    from gqakit.core.convrecord import read_conversion_record

    rec, first = read_conversion_record(folder), None
    for _ in range(8):
        if rec is None or not rec.settings.source:
            break
        if first is None:
            first = rec.settings
        elif rec.num_kv_heads != rec.num_kv_heads_before:
            break  # two grouping steps: no one GGUF conversion gives the same model
        src = Path(rec.settings.source)
        if src.suffix.lower() == ".gguf":
            if first.num_kv_heads is None or first.method is None:
                break
            grouping = f" --grouping {first.grouping}" if first.grouping else ""
            data = " with the same calibration data" if first.calibration_data else ""
            return (f"make one from its GGUF source{data} with `gqakit convert {src} {folder.name}.gguf "
                    f"-g {first.num_kv_heads} --method {first.method}{grouping}` (add --gguf-type F32 to keep the "
                    "changed weights unquantised)")
        rec = read_conversion_record(src) if src.is_dir() else None
    return ("gqakit writes GGUF from a GGUF source only (`gqakit convert SRC.gguf OUT.gguf -g G`); write this "
            "folder as GGUF with llama.cpp's convert_hf_to_gguf.py (`python convert_hf_to_gguf.py "
            f"{folder} --outfile {folder.name}.gguf`)")


def resolve_gguf(model: Path, gguf_file: str | None) -> Path:
    """The .gguf file to load: MODEL itself, MODEL/gguf_file (or gguf_file as a path), or the one
    .gguf in the folder MODEL; a model folder without one is refused with how to write it."""
    model = Path(model).expanduser()
    if gguf_file is not None:
        path = Path(gguf_file).expanduser()
        path = path if path.is_absolute() or model.is_file() else model / path
        if model.is_file() and path != model and not path.is_file():
            path = model.parent / gguf_file
        if not path.is_file():
            raise GqakitError(f"GGUF file not found: {path}")
        model = path
    if model.is_file():
        if model.suffix.lower() != ".gguf":
            raise GqakitError(f"llama.cpp loads a .gguf file; {model} is not one")
        return model
    if not model.exists():
        raise GqakitError(f"model not found: {model}")
    found = sorted(p for p in model.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) == 1:
        return found[0]
    if found:
        raise GqakitError(f"{model} holds {len(found)} .gguf files ({', '.join(p.name for p in found[:4])}); "
                          "name one with gguf_file (--gguf-file)")
    if (model / "config.json").is_file():
        raise GqakitError(f"llama.cpp loads a .gguf, and {model} is a model folder without one: "
                          f"{_folder_source_hint(model)}")
    raise GqakitError(f"{model} holds no .gguf file for llama.cpp")


KV_TYPES = ("F16", "F32", "BF16", "Q8_0", "Q4_0")  # cache types llama.cpp offers (-ctk / -ctv); F16 is its default


def kwargs_flash_attn(llm: Any) -> bool:
    """Whether llama.cpp runs LLM with flash attention (llama-cpp-python's `flash_attn`, off by default)."""
    params = getattr(llm, "context_params", None)
    kind = getattr(params, "flash_attn_type", None)
    return bool(kind is not None and int(kind) == 1)  # LLAMA_FLASH_ATTN_TYPE_ENABLED


def llama_kwargs(path: Path, options: EngineOptions, kv_type: str = "F16") -> dict[str, Any]:
    """The keyword arguments of `llama_cpp.Llama` for OPTIONS and a KV-cache type (each refusal
    in one line)."""
    if options.dtype != "auto":
        raise GqakitError(f"llama.cpp computes in the GGUF's own tensor types, not --dtype {options.dtype}; "
                          "choose the types when writing the GGUF (gqakit convert ... --gguf-type)")
    if options.kv_budget_bytes is not None:
        raise GqakitError("llama.cpp sizes its KV cache by the context length (max_len), not by a byte budget")
    kw: dict[str, Any] = {"model_path": str(path), "n_ctx": options.max_len, "n_batch": min(N_BATCH, options.max_len),
                          "logits_all": False, "verbose": False}
    if options.threads is not None:
        kw |= {"n_threads": options.threads, "n_threads_batch": options.threads}
    if kv_type != "F16":
        if kv_type not in KV_TYPES:
            raise GqakitError(f"llama.cpp KV-cache type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        from gguf import GGMLQuantizationType

        kw["type_k"] = kw["type_v"] = GGMLQuantizationType[kv_type].value
    return kw


def log_softmax_at(logits: Any, index: int) -> float:
    """log p(index) under softmax(logits), in float64 (LOGITS: a numpy array)."""
    import numpy as np

    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[index] - m - math.log(float(np.exp(x - m).sum())))


class LlamaCppEngine:
    name: ClassVar[str] = "llama.cpp"
    formats: ClassVar[tuple[str, ...]] = ("gguf",)

    def __init__(self, kv_type: str = "F16") -> None:
        self.kv_type = kv_type  # the cache's ggml type, F16 as llama.cpp's own default
        self.llm: Any = None
        self.path: Path | None = None
        self.options: EngineOptions | None = None

    # ------------------------------------------------------------------ load
    def load(self, model: Path, options: EngineOptions) -> None:
        options = EngineOptions.model_validate(options)
        path = resolve_gguf(Path(model), options.gguf_file)
        kwargs = llama_kwargs(path, options, self.kv_type)
        llama_cpp = import_llama_cpp()
        LOG.clear()
        try:
            llm = llama_cpp.Llama(**kwargs)
        except (ValueError, RuntimeError) as e:
            said = first_error()
            raise GqakitError(f"llama.cpp could not load {path}: {str(e).splitlines()[0] if str(e) else e}"
                              + (f" (llama.cpp: {said})" if said else "")) from e
        if llama_cpp.llama_model_has_encoder(llm.model):
            llm.close()
            raise GqakitError(f"{path.name} is an encoder-decoder GGUF: this engine serves decoder-only models "
                              "(llama.cpp runs an encoder through llama_encode, which gqakit does not drive)")
        self.close()
        self.llm, self.path, self.options, self._cpp = llm, path, options, llama_cpp

    def _need(self) -> Any:
        if self.llm is None:
            raise GqakitError("the llama.cpp engine has no model loaded")
        return self.llm

    def _last_logits(self) -> Any:
        import numpy as np

        llm = self.llm
        ptr = self._cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

    def _check_room(self, tokens: int) -> None:
        n_ctx = self.llm.n_ctx()
        if tokens > n_ctx:
            raise GqakitError(f"{tokens} tokens do not fit llama.cpp's context of {n_ctx} (max_len "
                              f"{self.options.max_len}); load with a larger max_len")

    def _start(self, ids: list[int]) -> None:
        """Clear the cache and process IDS (the prompt) in llama.cpp's batches."""
        self.llm.reset()
        self.llm.eval(ids)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        llm = self._need()
        n_vocab = llm.n_vocab()
        t0 = time.perf_counter()
        tokens, logprobs = [], []
        for prompt in prompts:
            if not prompt:
                raise GqakitError("llama.cpp needs at least one prompt token")
            if not all(0 <= t < n_vocab for t in prompt):
                raise GqakitError(f"a prompt token id is outside llama.cpp's vocabulary of {n_vocab}")
            self._check_room(len(prompt) + max_new_tokens)
            self._start(list(prompt))
            got, lps = [], []
            for i in range(max_new_tokens):
                logits = self._last_logits()
                tok = int(logits.argmax())
                got.append(tok)
                lps.append(log_softmax_at(logits, tok))
                if i + 1 < max_new_tokens:
                    llm.eval([tok])
            tokens.append(got)
            logprobs.append(lps)
        return Generation(tokens=tokens, logprobs=logprobs, seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------ speed
    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming:
        if batch != 1:
            raise GqakitError(f"llama.cpp (llama-cpp-python) serves one sequence per context: batch must be 1, "
                              f"not {batch}")
        llm = self._need()
        if prompt_len < 1 or new_tokens < 1 or reps < 1 or warmup < 0:
            raise GqakitError("a llama.cpp speed point needs prompt_len, new_tokens and reps of at least 1")
        self._check_room(prompt_len + new_tokens)
        n_vocab = llm.n_vocab()
        ids = [(7 + 7919 * i) % n_vocab for i in range(prompt_len)]  # fixed ids: speed does not read their text
        prefill, decode = [], []
        for rep in range(warmup + reps):
            t0 = time.perf_counter()
            self._start(ids)
            t1 = time.perf_counter()
            tok, steps = int(self._last_logits().argmax()), []
            for _ in range(new_tokens):
                s0 = time.perf_counter()
                llm.eval([tok])
                tok = int(self._last_logits().argmax())
                steps.append(time.perf_counter() - s0)
            if rep >= warmup:
                prefill.append(t1 - t0)
                decode.extend(steps)
        return PointTiming(prefill_s=prefill, decode_s=decode)

    # ------------------------------------------------------------------ KV cache
    def kv_allocation(self) -> KvAllocation:
        llm = self._need()
        cpp = self._cpp
        if llm.n_tokens == 0:  # the state holds only cells in use: put one token in, then take it out
            llm.eval([0])
            state = self._seq_state()
            llm.reset()
            cpp.llama_memory_seq_rm(cpp.llama_get_memory(llm.ctx), -1, 0, -1)
        else:
            state = self._seq_state()
        n_layer = cpp.llama_model_n_layer(llm.model)
        kv = read_kv_state(state, n_layer)
        capacity = int(cpp.llama_n_ctx(llm.ctx))
        geometry = gguf_geometry(llm.metadata)
        detail = {"n_ctx": capacity, "n_ctx_asked": self.options.max_len, "layers": n_layer,
                  "type_k": sorted(set(kv.k_types)), "type_v": sorted(set(kv.v_types)), "v_transposed": kv.v_trans,
                  # the one type of every K and V row, as the serving check's prediction needs it
                  "cache_dtype": kv.k_types[0] if len(set(kv.k_types + kv.v_types)) == 1 else None,
                  "k_row_bytes": sorted(set(kv.k_rows)), "v_row_bytes": sorted(set(kv.v_rows)),
                  "predicted_bytes_per_token": predicted_bytes_per_token(geometry, kv.k_types[0], kv.v_types[0])
                  if len(set(kv.k_types)) == 1 and len(set(kv.v_types)) == 1 and geometry["kv_heads"] else None,
                  # llama.cpp without flash attention (as this engine loads it) pads every layer's V
                  # rows to the widest layer's when the layers' widths differ (llama_kv_cache:
                  # "padding V cache"); K keeps each layer's own width
                  "v_padded_to_widest_layer": not kwargs_flash_attn(self.llm),
                  "geometry": geometry, "threads": int(cpp.llama_n_threads(llm.ctx)),
                  "source": "llama_state_seq_get_data (one sequence's K and V rows) x llama_n_ctx"}
        return KvAllocation(bytes_per_token=kv.bytes_per_token, capacity_tokens=capacity,
                            total_bytes=capacity * kv.bytes_per_token, detail=detail)

    def _seq_state(self) -> bytes:
        import ctypes

        cpp, ctx = self._cpp, self.llm.ctx
        size = cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = cpp.llama_state_seq_get_data(ctx, buf, size, 0)
        return bytes(buf[:n])

    def step_bytes(self) -> tuple[int, int]:
        """(bytes of the weights one decode step reads, KV bytes per cached token) in llama.cpp's
        own storage: the GGUF's tensor types (quantised weights are read as stored) and its
        cache's rows (F16 by default), not the float32 model transformers dequantises."""
        return gguf_step_weight_bytes(self.path), self.kv_allocation().bytes_per_token

    def weight_types(self) -> dict[str, int]:
        """How many tensors of each ggml type the GGUF holds (what its quantisation is)."""
        from gguf import GGUFReader

        counts: dict[str, int] = {}
        for t in GGUFReader(self.path).tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
