"""The README's Quick start is examples/quickstart.py, character for character, and it runs as
written (2 CPU ranks through fxpar.launch, and under torchrun)."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "quickstart.py"


def test_readme_quick_start_is_the_script():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == SCRIPT.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["python", "torchrun"])
def test_quick_start_runs_as_written(tmp_path, runner):
    script = tmp_path / "quickstart.py"  # a user's copy, outside the repository
    script.write_text(SCRIPT.read_text())
    cmd = [sys.executable, str(script)] if runner == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("plan Plan(")]
    assert len(line) == 1, r.stdout[-2000:]  # printed on rank 0 only
    assert re.search(r"loss \d+\.\d+, eval \d+\.\d+, \d+ tensors", line[0]), line[0]
    assert "Traceback" not in r.stderr
