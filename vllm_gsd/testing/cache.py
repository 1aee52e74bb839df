"""The test bed's cache directory and a crash- and race-safe "build once" helper."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV_VAR = "VLLM_GSD_CACHE"


def cache_root() -> Path:
    """Return the cache directory: $VLLM_GSD_CACHE, else ~/.cache/vllm-gsd (created if missing)."""
    root = Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "vllm-gsd")
    root.mkdir(parents=True, exist_ok=True)
    return root


def recipe_key(recipe: dict) -> str:
    """Return a 12-hex-digit key of a JSON-serialisable recipe (sorted keys, so order is irrelevant)."""
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def build_once(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Return `final_dir`, first creating it with `build(tmp_dir)` if it does not exist yet.

    Contract: `final_dir` either does not exist or is complete. `build` writes into an empty
    temporary directory beside `final_dir`, which is then renamed into place (atomic on one
    file system). An exclusive file lock makes concurrent callers (other processes, e.g.
    pytest-xdist workers) wait for the first builder instead of building twice. A crash leaves
    only a stray `.tmp-*` directory, never a half-written `final_dir`.
    """
    final_dir = Path(final_dir)
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final_dir.parent / f".{final_dir.name}.lock"
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if final_dir.is_dir():
                return final_dir
            tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{final_dir.name}-", dir=final_dir.parent))
            try:
                build(tmp_dir)
                tmp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is shared
                os.rename(tmp_dir, final_dir)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return final_dir
