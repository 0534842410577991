"""A hash of fxpar's own source, per package folder: what results fxpar keeps on disk are
keyed by (compiled runs, the machine's measurements), so that an edited or upgraded fxpar
never reuses one its older code made."""
from __future__ import annotations

import functools
import hashlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def source_version(*paths: str) -> str:
    """16 hex digits of the names and contents of these .py files of fxpar and of the .py
    files in these folders of it."""
    h = hashlib.sha256()
    for p in paths:
        files = [p] if p.endswith(".py") else [
            f"{p}/{name}" for name in sorted(os.listdir(os.path.join(ROOT, p)))
            if name.endswith(".py")]
        for rel in files:
            with open(os.path.join(ROOT, rel), "rb") as f:
                h.update(rel.encode() + f.read())
    return h.hexdigest()[:16]
