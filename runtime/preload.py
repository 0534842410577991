"""Imported by fxpar.launch's forkserver as it starts: the modules of the caller's model
libraries (FXPAR_PRELOAD, set by runtime/dist.launch), so every rank forks with them loaded
instead of importing them itself (seconds per rank for transformers and its model classes)."""
import importlib
import os

for _name in filter(None, os.environ.get("FXPAR_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the rank imports it itself and reports its error there
        pass
