"""Atomic writes: build the new file or folder beside its target, then os.replace it into place."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError


def temp_dir_beside(target: Path, tag: str = "tmp") -> Path:
    """A fresh hidden folder on the same filesystem as `target` (so a rename is atomic), with the permissions a
    plain mkdir would give (mkdtemp's are 0700, which would leave the finished checkpoint unreadable to others)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    set_plain_mode(tmp)
    return tmp


def check_writable_folder(path: Path, what: str) -> None:
    """Fail before any work is done when `path` cannot be written as a folder: it is a file, or its nearest
    existing ancestor is not a folder this process may create entries in. `what` names it in the error."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise QuantkitError(f"{path}: {what} is a file, not a folder")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QuantkitError(f"{path}: {what} cannot be created: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise QuantkitError(f"{path}: {what} cannot be written: {ancestor} is not writable")


def set_plain_mode(path: Path) -> None:
    """Give a file or folder the permissions a plain open() or mkdir would (0666 / 0777 less the umask): mkstemp,
    mkdtemp and safetensors' writer create theirs 0600 / 0700, unreadable to the other users of a model."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def write_json(path: Path, data: Any) -> None:
    """Atomic: a temp file in the same folder, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        set_plain_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
