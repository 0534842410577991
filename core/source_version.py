"""A hash of fxpar's own source, per package folder: what results fxpar keeps on disk are
keyed by (compiled runs, the machine's measurements), so that an edited or upgraded fxpar
never reuses one its older code made."""
from __future__ import annotations

import functools
import hashlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def source_version(*folders: str) -> str:
    """16 hex digits of the .py files' names and contents in these folders of fxpar."""
    h = hashlib.sha256()
    for d in folders:
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            if name.endswith(".py"):
                with open(os.path.join(ROOT, d, name), "rb") as f:
                    h.update(f"{d}/{name}".encode() + f.read())
    return h.hexdigest()[:16]
