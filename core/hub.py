"""Hugging Face Hub ids as model arguments, and the Hub id a model came from.

Wherever a user names a model (`gqakit convert SRC`, `inspect SRC`, `eval MODEL`,
uptrain's `model.path` and `teacher.path`), an existing local path is that path. Anything
else spelled like a Hub id, `org/name` with an optional `@revision`, is the snapshot
folder of that repository in the user's Hugging Face cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`), found by `huggingface_hub.snapshot_download`.
gqakit runs with `HF_HUB_OFFLINE=1` unless the user sets it to 0: offline, only the
cache is read and a model that is not there is one line saying how to get it; online,
`snapshot_download` fetches what the cache lacks.

A local folder or file always wins over a Hub id of the same spelling. `ModelRef` keeps the
Hub id and revision next to the folder, so records and model cards name the model by its
Hub id, never by a path inside someone's cache. Nothing here imports torch; huggingface_hub
is imported only when a Hub id has to be resolved.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError

# `org/name`, then an optional `@revision` (a branch, tag or commit; branches may hold `/`).
# Segments follow the Hub's repo-id rule: letters, digits, `-`, `_`, `.`, no `--` or `..`.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w.][\w./-]{0,199}))?$")
# the weight files a usable snapshot holds at least one of
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")
# a snapshot folder inside a Hugging Face cache: models--org--name/snapshots/<commit>
CACHE_SNAPSHOT = re.compile(r"^models--(?P<org>[^-].*?)--(?P<name>.+)$")
TRUTHY = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class ModelRef:
    """A model argument resolved: the local `path`, and for a Hub id the repository, the
    revision asked for (None: the default branch) and the snapshot's commit."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def hub_id(self) -> str | None:
        """`org/name`, or `org/name@revision` when a revision other than main was asked for."""
        if self.repo_id is None:
            return None
        return self.repo_id + (f"@{self.revision}" if self.revision not in (None, "main") else "")

    @property
    def name(self) -> str:
        """How to name the model to someone else: its Hub id, else the folder or file name."""
        return self.hub_id or self.path.name

    def record(self) -> dict[str, str] | None:
        """The Hub provenance for a record: repository, revision asked for and commit; None for a local path."""
        if self.repo_id is None:
            return None
        return {"repo_id": self.repo_id, "revision": self.revision or "main", "commit": self.commit or ""}


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when TEXT is spelled like a Hub id, else None."""
    m = HUB_ID.match(text)
    if m is None:
        return None
    repo = m.group("repo")
    if "--" in repo or ".." in repo or any(p.endswith((".", "-")) for p in repo.split("/")):
        return None
    if repo.lower().endswith((".gguf", ".json", ".yaml", ".yml", ".txt")):  # a file path, not a repository
        return None
    return repo, m.group("rev")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the user's environment sets it now."""
    env = os.environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """True unless the user set HF_HUB_OFFLINE to something false (gqakit's default is offline)."""
    return os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() in TRUTHY


def resolve_model_ref(ref: str | os.PathLike[str]) -> ModelRef:
    """REF as a local path when one exists (or when REF is not spelled like a Hub id, so the
    caller's own "not found" line applies); else the Hub id's snapshot folder in the cache,
    or one GqakitError that says how to download it."""
    text = os.fspath(ref)
    local = Path(text).expanduser()
    if local.exists() or local.is_symlink():
        return ModelRef(local)
    parsed = parse_hub_id(text)
    if parsed is None:
        return ModelRef(local)
    repo_id, revision = parsed
    folder = _snapshot(repo_id, revision, text)
    return ModelRef(folder, repo_id, revision, folder.name)


def _snapshot(repo_id: str, revision: str | None, text: str) -> Path:
    cache = hub_cache_dir()
    how = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    offline = hub_offline()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise GqakitError(f"model {text}: not a local path, and reading the Hugging Face cache needs the "
                          "huggingface_hub package (pip install huggingface_hub)") from None
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline))
    except HFValidationError:
        raise GqakitError(f"model not found: {text} is neither a local path nor a valid Hugging Face Hub id") from None
    except Exception as e:  # LocalEntryNotFoundError, OfflineModeIsEnabled, HTTP and repository errors, OSError
        why = "" if offline else f"; the download failed: {_first_line(e)}"
        raise GqakitError(f"model {text} is not in the Hugging Face cache ({cache}; no local path of that name "
                          f"either{', HF_HUB_OFFLINE=1' if offline else ''}{why}); download it with: {how}") from None
    if not any(next(folder.glob(p), None) is not None for p in WEIGHTS):
        raise GqakitError(f"model {text} is only partly in the Hugging Face cache ({folder} holds no weights); "
                          f"download it with: {how}")
    return folder


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def hub_id_of(folder: str | os.PathLike[str], config: dict[str, Any] | None = None) -> str | None:
    """The Hub id a local model folder is a copy of, when it says so: a snapshot folder inside a
    Hugging Face cache (`models--org--name/snapshots/<commit>`), or a config whose `_name_or_path`
    is a Hub id (and no local path). None when neither does: a model card's `base_model` must
    be a Hub id, so it is then left out."""
    p = Path(folder).expanduser().absolute()
    for snap in (p, p.parent):  # a folder, or a file (a .gguf) in one
        m = CACHE_SNAPSHOT.match(snap.parent.parent.name) if snap.parent.name == "snapshots" else None
        if m is not None and parse_hub_id(f"{m.group('org')}/{m.group('name')}") is not None:
            return f"{m.group('org')}/{m.group('name')}"
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and parse_hub_id(name) is not None and "@" not in name and not Path(name).exists():
        return name
    return None
