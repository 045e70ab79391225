"""Training data: find documents, tokenize them (cached), pack them into fixed blocks.

Documents come from local text/jsonl/parquet files, an in-memory list, a `datasets`
hub name (online only) or text sampled from the teacher model. They are tokenized with
the student's own tokenizer through `datasets.map`, whose fingerprinted cache means a
second run with the same files and tokenizer does not tokenize again. Tokens are then
concatenated with EOS between documents and cut into blocks of `seq_len`: every
position of every block is a real token, so no compute is wasted on padding.

Without `datasets` installed (a bare GPU image, say), plain-text and JSON-lines files and
in-memory documents are still read, split and tokenized the same way in plain Python
(no tokenization cache); parquet and hub data sets need it.

Sharding is done by `BlockOrder`, not by a DataLoader: the order of blocks is a pure
function of (seed, global sample index). That is what makes `--resume` reproduce the
one-go run exactly, and what makes 1 process with grad_accum=4 see the same blocks per
optimizer step as 2 processes with grad_accum=2.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gqakit.core.errors import GqakitError, first_line
from gqakit.core.files import gqakit_cache_dir
from gqakit.core.tokens import SAMPLER_VERSION, bos_id, sample_tokens
from gqakit.uptrain.config import DataCfg, TeacherSamplesCfg
from gqakit.uptrain.preflight import resolve_data

TEXT_SUFFIXES = {".txt", ".raw", ".md", ".text"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}


def default_cache_dir(cfg: DataCfg) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return gqakit_cache_dir()


# --------------------------------------------------------------------------- files


def _builder(files: list[Path], what: str) -> str:
    kinds = set()
    for f in files:
        s = f.suffix.lower()
        kinds.add("text" if s in TEXT_SUFFIXES else "json" if s in JSON_SUFFIXES
                  else "parquet" if s in PARQUET_SUFFIXES else s)
    if len(kinds) > 1:
        raise GqakitError(f"{what}: mixes file types {sorted(kinds)}; use one type per run")
    kind = kinds.pop()
    if kind not in {"text", "json", "parquet"}:
        raise GqakitError(f"{what}: unsupported file type {kind!r} (use .txt, .jsonl, .json or .parquet)")
    return kind


def have_datasets() -> bool:
    """Whether the `datasets` package can be imported (it is optional for local text)."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def split_text(text: str, sample_by: str) -> list[str]:
    """Documents of one text file, split as `datasets`' text builder splits them.

    line: each line, without its newline; paragraph: pieces between blank lines ("\\n\\n"),
    empty pieces dropped; document: the whole file.
    """
    if sample_by == "line":
        return [line.rstrip("\n") for line in io.StringIO(text).readlines()]
    if sample_by == "paragraph":
        return [p for p in text.split("\n\n") if p]
    return [text]


def read_documents(files: list[Path], *, text_field: str, sample_by: str, what: str) -> list[str]:
    """`load_documents` without `datasets`: text and JSON-lines files, as a list of strings."""
    kind = _builder(files, what)
    if kind == "parquet":
        raise GqakitError(f"{what}: parquet files need the `datasets` package (pip install datasets); "
                          "or give .txt / .jsonl files")
    docs: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")  # universal newlines, as the text builder reads
        except (OSError, UnicodeDecodeError) as e:
            raise GqakitError(f"{what}: cannot read {f.name}: {e}") from None
        if kind == "text":
            docs += split_text(text, sample_by)
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise GqakitError(f"{what}: {f.name} line {n} is not JSON; without the `datasets` package "
                                  "only JSON-lines files are read") from None
            if not isinstance(row, dict) or text_field not in row:
                raise GqakitError(f"data.text_field: {f.name} line {n} has no field {text_field!r}")
            docs.append(str(row[text_field]))
    return docs


def load_documents(files: list[Path], *, text_field: str, sample_by: str, cache_dir: Path, what: str) -> Any:
    """A `datasets.Dataset` with one column `text`, one row per document."""
    import datasets

    datasets.disable_progress_bars()
    kind = _builder(files, what)
    kwargs: dict[str, Any] = {"sample_by": sample_by} if kind == "text" else {}
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train",
                                   cache_dir=str(cache_dir / "datasets"), **kwargs)
    except Exception as e:  # datasets raises many types for unreadable files
        raise GqakitError(f"{what}: cannot read {[f.name for f in files]}: {first_line(e, None)}") from None
    field = "text" if kind == "text" else text_field
    if field not in ds.column_names:
        raise GqakitError(f"data.text_field: {what} has no field {field!r} (fields: {ds.column_names})")
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.select_columns(["text"])


def hub_documents(cfg: DataCfg, cache_dir: Path) -> Any:
    import datasets

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise GqakitError(f"data.hf_dataset: {cfg.hf_dataset!r} needs the Hub, but HF_HUB_OFFLINE=1; use data.files")
    try:
        ds = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config, split=cfg.hf_split, cache_dir=str(cache_dir / "datasets"))
    except Exception as e:
        raise GqakitError(f"data.hf_dataset: cannot load {cfg.hf_dataset!r}: {first_line(e, None)}") from None
    if cfg.text_field not in ds.column_names:
        raise GqakitError(f"data.text_field: {cfg.hf_dataset} has no field {cfg.text_field!r} (fields: {ds.column_names})")
    return ds.rename_column(cfg.text_field, "text").select_columns(["text"]) if cfg.text_field != "text" else ds.select_columns(["text"])


# --------------------------------------------------------------------------- tokenize + pack


def _encoder(tokenizer: Any, add_bos: bool, add_eos: bool) -> Callable[[list[str]], list[list[int]]]:
    """Documents -> token ids, with BOS before and EOS after each when asked; blank ones -> []."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if add_bos and bos is None:
        raise GqakitError("data.add_bos: the tokenizer has no BOS token")
    if add_eos and eos is None:
        raise GqakitError("data.add_eos: the tokenizer has no EOS token; set data.add_eos=false")

    def encode(texts: list[str]) -> list[list[int]]:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for doc, text in zip(ids, texts):
            if not text.strip():
                out.append([])
                continue
            out.append(([bos] if add_bos else []) + doc + ([eos] if add_eos else []))
        return out

    return encode


def tokenize(ds: Any, tokenizer: Any, *, add_bos: bool, add_eos: bool = True, num_proc: int | None = None) -> Any:
    """Map documents to token ids, with BOS before and EOS after each when asked.

    `datasets` fingerprints this function together with the tokenizer, and stores the
    result next to the source's arrow files: a second run loads it instead of re-tokenizing.
    """
    encode = _encoder(tokenizer, add_bos, add_eos)
    return ds.map(lambda batch: {"input_ids": encode(batch["text"])}, batched=True, batch_size=1000,
                  remove_columns=ds.column_names, num_proc=num_proc, desc="tokenizing")


def tokenize_list(texts: list[str], tokenizer: Any, *, add_bos: bool, add_eos: bool = True) -> list[list[int]]:
    """`tokenize` without `datasets` (and without its cache), 1,000 documents at a time."""
    encode = _encoder(tokenizer, add_bos, add_eos)
    return [ids for i in range(0, len(texts), 1000) for ids in encode(texts[i:i + 1000])]


def pack(tokenized: Any, seq_len: int, what: str, block: str | None = None) -> torch.Tensor:
    """Concatenate all documents and cut them into [N, seq_len] blocks (the tail is dropped).

    `tokenized` is a tokenized `datasets.Dataset` or a list of token-id lists.
    """
    col = tokenized if isinstance(tokenized, list) else tokenized.with_format("numpy")["input_ids"]
    parts = [np.asarray(x, dtype=np.int64) for x in col if len(x)]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(flat) // seq_len
    if n == 0:
        raise GqakitError(f"{what}: only {len(flat)} tokens, fewer than one block of {block or f'train.seq_len={seq_len}'}")
    return torch.from_numpy(flat[: n * seq_len].reshape(n, seq_len).copy())


# --------------------------------------------------------------------------- teacher samples




def teacher_samples_file(ts: TeacherSamplesCfg, teacher_path: Path, cache_dir: Path,
                         main_first: Callable[[], Any] = nullcontext, is_main: bool = True,
                         progress: bool = True) -> Path:
    """Sample documents from the teacher once and cache them as jsonl; later runs reuse the file."""
    from gqakit.core.loading import load_causal_lm, load_tokenizer

    weights = ([teacher_path] if teacher_path.is_file() else  # a .gguf file
               sorted(teacher_path.glob("*.safetensors")) + sorted(teacher_path.glob("*.bin")))
    ident = [str(teacher_path.resolve())] + [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights]
    key = hashlib.sha256(json.dumps([ident, ts.model_dump(), SAMPLER_VERSION], sort_keys=True).encode()).hexdigest()[:16]
    out = cache_dir / "teacher_samples" / f"{teacher_path.name}-{key}.jsonl"
    with main_first():
        if out.is_file() or not is_main:
            return out
        from tqdm.auto import tqdm

        tok = load_tokenizer(teacher_path)
        model = load_causal_lm(teacher_path, device="cuda" if torch.cuda.is_available() else "cpu")
        # Sampling must start from BOS: e.g. stories260K's tokenizer adds none by itself.
        bos = bos_id(tok, eos_fallback=True)
        prompt = [bos] + tok(ts.prompt, add_special_tokens=False)["input_ids"] if ts.prompt else [bos]
        eos = tok.eos_token_id
        rows = []
        # fork_rng: sampling must not move the training RNG streams.
        cuda = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.inference_mode():
            torch.manual_seed(ts.seed)
            bar = tqdm(total=ts.num, desc="sampling teacher text", unit="seq", disable=not progress)
            done = 0
            while done < ts.num:
                b = min(ts.batch_size, ts.num - done)
                done += b
                gen = sample_tokens(model, prompt, b, ts.length, temperature=ts.temperature, top_k=ts.top_k)
                for seq in gen.tolist():
                    if eos is not None and eos in seq:
                        seq = seq[: seq.index(eos)]
                    # A model trained on BOS-separated documents (llama2.c) starts a new
                    # one after BOS: split there instead of gluing two documents together.
                    first = True
                    for piece in _split(seq, bos):
                        text = (ts.prompt if first else "") + tok.decode(piece, skip_special_tokens=True)
                        first = False
                        if text.strip():
                            rows.append({"text": text})
                bar.update(b)
            bar.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, out)  # atomic: a killed run never leaves half a cache file
        del model
    return out


def _split(seq: list[int], sep: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for t in seq:
        if t == sep:
            out.append([])
        else:
            out[-1].append(t)
    return [p for p in out if p]


# --------------------------------------------------------------------------- build


def build_blocks(cfg: DataCfg, tokenizer: Any, seq_len: int, *, files: Sequence[Path] | None = None,
                 eval_files: Sequence[Path] | None = None, teacher_path: Path | None = None,
                 main_first: Callable[[], Any] = nullcontext, is_main: bool = True,
                 progress: bool = True, block: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(train blocks [N, S], eval blocks [M, S] or None).

    FILES and EVAL_FILES are `data.files` and `data.eval_file` as preflight resolved and
    checked them (`preflight.resolve_data`, which runs here when they are not given)."""
    if files is None or eval_files is None:
        files, eval_files = resolve_data(cfg)
    files, eval_files = list(files), list(eval_files)
    use_ds = have_datasets()
    cache = default_cache_dir(cfg)

    def documents(files: list[Path] | None, texts: list[str] | None, sample_by: str, text_field: str, what: str) -> Any:
        """A `datasets.Dataset` of documents, or a plain list of them without `datasets`."""
        if files is not None:
            if use_ds:
                return load_documents(files, text_field=text_field, sample_by=sample_by, cache_dir=cache, what=what)
            return read_documents(files, text_field=text_field, sample_by=sample_by, what=what)
        if use_ds:
            import datasets

            return datasets.Dataset.from_dict({"text": list(texts or [])})
        return list(texts or [])

    def blocks(docs: Any, num_proc: int | None, what: str) -> torch.Tensor:
        kw = {"add_bos": cfg.add_bos, "add_eos": cfg.add_eos}
        ids = tokenize(docs, tokenizer, num_proc=num_proc, **kw) if use_ds else tokenize_list(docs, tokenizer, **kw)
        return pack(ids, seq_len, what, block)

    with main_first():  # one process tokenizes and fills the cache, the others then read it
        if cfg.files:
            docs = documents(files, None, cfg.sample_by, cfg.text_field, "data.files")
        elif cfg.texts is not None:
            if not any(t.strip() for t in cfg.texts):
                raise GqakitError("data.texts: all documents are empty")
            docs = documents(None, cfg.texts, cfg.sample_by, cfg.text_field, "data.texts")
        elif cfg.hf_dataset is not None:
            if not use_ds:
                raise GqakitError("data.hf_dataset: needs the `datasets` package (pip install datasets)")
            docs = hub_documents(cfg, cache)
        else:
            assert teacher_path is not None and cfg.teacher_samples is not None
            f = teacher_samples_file(cfg.teacher_samples, teacher_path, cache, is_main=is_main, progress=progress)
            docs = documents([f], None, "document", "text", "data.teacher_samples")
        train = blocks(docs, cfg.num_proc, "training data")

        held: torch.Tensor | None = None
        if eval_files or cfg.eval_texts is not None:
            if eval_files:
                edocs = documents(eval_files, None, cfg.sample_by, cfg.text_field, "data.eval_file")
            else:
                edocs = documents(None, cfg.eval_texts, cfg.sample_by, cfg.text_field, "data.eval_texts")
            held = blocks(edocs, None, "data.eval_file")
            if cfg.eval_max_blocks:
                held = held[: cfg.eval_max_blocks]
    return train, held


class BlockOrder:
    """Which blocks each process reads at each optimizer step: a pure function of the step.

    Global sample i lives in epoch i // N at position i % N of a permutation seeded by
    (seed, epoch). Optimizer step t reads global samples [t*GB, (t+1)*GB), GB being the
    global batch, and hands slot j to accumulation step j // (world*micro) of process
    (j // micro) % world. Resuming at step t needs nothing but t.
    """

    def __init__(self, num_blocks: int, *, seed: int, micro: int, accum: int, world: int, rank: int):
        self.n, self.seed, self.micro, self.accum, self.world, self.rank = num_blocks, seed, micro, accum, world, rank
        self.global_batch = micro * accum * world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch in memory
        return self._perms[epoch]

    def samples(self, step: int, accum_index: int) -> list[int]:
        """The global sample indices this process reads at (step, accum_index)."""
        start = step * self.global_batch + (accum_index * self.world + self.rank) * self.micro
        return list(range(start, start + self.micro))

    def indices(self, step: int, accum_index: int) -> list[int]:
        """The blocks of those samples."""
        return [int(self._perm(i // self.n)[i % self.n]) for i in self.samples(step, accum_index)]

    def epochs(self, steps: int) -> float:
        return steps * self.global_batch / self.n
