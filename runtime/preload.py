"""Imported by fxpar.launch's forkserver as it starts: the modules of the caller's model
libraries (FXPAR_PRELOAD, set by runtime/dist.launch), so every rank forks with them loaded
instead of importing them itself (seconds per rank for transformers and its model classes).
A library that fails to import here (e.g. one needing what only the caller's process set
up) is left to the ranks, which import it themselves and report its error there."""
import importlib
import os

_failed: set[str] = set()  # libraries that do not import at all: their modules not tried
for _name in filter(None, os.environ.get("FXPAR_PRELOAD", "").split(",")):
    _library = _name.partition(".")[0]
    if _library in _failed:
        continue
    try:
        importlib.import_module(_name)
    except (Exception, SystemExit):  # noqa: BLE001 - the forkserver must not die of it
        try:  # (one module failing, e.g. an optional integration: the others still load)
            importlib.import_module(_library)
        except (Exception, SystemExit):  # noqa: BLE001
            _failed.add(_library)
