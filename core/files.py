"""Small helpers on files that every stage uses."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def gqakit_cache_dir() -> Path:
    """gqakit's own cache (the built CPU kernels, uptrain's tokenized data): GQAKIT_CACHE, or
    ~/.cache/gqakit."""
    return Path(os.environ.get("GQAKIT_CACHE", "~/.cache/gqakit")).expanduser()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """The hex sha256 of a file's bytes, read in chunks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def format_bytes(n: float | None, *, digits: int = 2, thousands: bool = True, largest: str = "TiB") -> str:
    """A byte count in binary units: `format_bytes(3 << 30)` -> '3.00 GiB'; whole bytes below 1 KiB;
    'n/a' for None."""
    if n is None:
        return "n/a"
    sep = "," if thousands else ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == largest:
            return f"{n:{sep}.0f} {unit}" if unit == "B" else f"{n:{sep}.{digits}f} {unit}"
        n /= 1024
    return str(n)


def current_umask() -> int:
    """The process's umask, read without changing it where /proc allows (no window in which
    another thread would create files under a different mask)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Give every file and folder under ROOT (and ROOT) the mode a new one gets from the user's
    umask: 0644 / 0755 under umask 022, 0600 / 0700 under 077. Libraries that write through a
    temporary file (safetensors' `save_file`, `tempfile.mkstemp`) leave 0600 behind, and
    `shutil.copy2` keeps a read-only source's mode; an output is a new file the user owns,
    readable as the umask allows, like any other tool's. Symbolic links are left alone."""
    mask = current_umask()
    want_file, want_dir = 0o666 & ~mask, 0o777 & ~mask

    def fix(p: str, want: int) -> None:
        st = os.lstat(p)
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != want:
            os.chmod(p, want)

    root = Path(root)
    if root.is_file():
        fix(str(root), want_file)
        return
    for folder, dirs, files in os.walk(root):
        fix(folder, want_dir)
        for name in files:
            fix(os.path.join(folder, name), want_file)
