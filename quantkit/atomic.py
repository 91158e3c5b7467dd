"""Atomic folder writes: build the new folder beside its target, then os.replace it into place."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def temp_dir_beside(target: Path, tag: str = "tmp") -> Path:
    """A fresh hidden folder on the same filesystem as `target` (so a rename is atomic), with the permissions a
    plain mkdir would give (mkdtemp's are 0700, which would leave the finished checkpoint unreadable to others)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp
