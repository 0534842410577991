#!/usr/bin/env bash
# Set up fxpar on a fresh machine: .venv with torch (CPU build when there is no GPU),
# fxpar in editable mode with its test deps, graphviz's `dot`, and Debian's chromium (the
# report's browser test; optional: without it that one test is skipped, saying so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  # Reuse an already-installed torch (system or user site) instead of downloading one.
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  TORCH_VERSION=${FXPAR_TORCH_VERSION:-2.13.0}
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    $PIP install "torch==$TORCH_VERSION"
  elif $PIP install --dry-run --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    # No GPU, and a local CPU wheel is on pip's find-links: it wins (2.13.0+cpu > 2.13.0).
    $PIP install "torch==$TORCH_VERSION"
  else
    # No GPU and no CPU wheel reachable through pip's own configuration: installing torch
    # from the default index would pull gigabytes of CUDA wheels, so stop and say how.
    echo "fxpar setup: no GPU here and pip finds no CPU build of torch==$TORCH_VERSION." >&2
    echo "Install a CPU torch first (configure pip's index or find-links for PyTorch's CPU" >&2
    echo "wheels, then: $PIP install torch==$TORCH_VERSION), or set PYTHON to an interpreter" >&2
    echo "that already has torch, and run make again." >&2
    exit 1
  fi
fi

# fxpar + runtime/test deps; torch is already satisfied so nothing CUDA is pulled.
$PIP install -q -e ".[test]"

# The external zoo's libraries (pyproject's `zoo` extra: timm, litgpt, torchtitan and the few
# light packages their model code imports), each pinned, with --no-deps: their declared
# dependencies include torchvision, lightning's loggers, datasets, wandb..., which the model
# code does not need and which would bring another torch or torchvision build. Skipped when
# every pin is already installed (~0.1 s); FXPAR_NO_ZOO=1 skips it; a failed install only
# warns (tests/test_external_zoo.py then skips, naming the missing library).
if [ "${FXPAR_NO_ZOO:-0}" != 1 ]; then
  ZOO_MISSING=$("$VENV/bin/python" - <<'EOF'
import tomllib
from importlib.metadata import PackageNotFoundError, version
pins = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["zoo"]
def installed(pin):
    name, want = pin.split("==")
    try:
        return version(name) == want
    except PackageNotFoundError:
        return False
print(" ".join(p for p in pins if not installed(p)))
EOF
)
  if [ -n "$ZOO_MISSING" ]; then
    # shellcheck disable=SC2086
    $PIP install -q --no-deps $ZOO_MISSING \
      || echo "warning: could not install the external zoo ($ZOO_MISSING); its tests will skip" >&2
  fi
fi

if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq graphviz >/dev/null
  else
    echo "warning: graphviz 'dot' not found; install graphviz to render SVGs" >&2
  fi
fi
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ ! -e "$VENV/.chromium-tried" ]; then  # tried once per .venv
  touch "$VENV/.chromium-tried"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null; } \
    || echo "warning: could not install chromium; tests/test_report_browser.py will skip" >&2
fi
echo "fxpar set up in $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
