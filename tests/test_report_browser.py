"""The demo's report.html in a real browser (headless Chromium, Debian's `chromium`): every
image decodes, no script error, every graph is shown inline with pan/zoom, every link to a
node-level drawing resolves; a screenshot is written for reviewers."""
import os
import re
import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") \
    or shutil.which("google-chrome")


def _chromium(*args, timeout=120):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--virtual-time-budget=10000", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: scripts/setup.sh installs Debian's "
                                             "chromium package where apt is available")
def test_demo_report_renders_in_chromium(tmp_path):
    from fxpar.examples.demo import main
    out = tmp_path / "out"
    main(str(out), nprocs=2, steps=10)
    report = out / "report.html"
    page = report.read_text()
    dom = _chromium("--dump-dom", report.as_uri()).stdout
    check = re.search(r'<p id="selfcheck"[^>]*data-ok="(\w+)"[^>]*>([^<]*)<', dom)
    assert check, "the page's check script did not run: " + dom[-2000:]
    assert check.group(1) == "yes", check.group(2)
    assert "page check: " in check.group(2) and "no script error" in check.group(2)
    n_graphs = page.count('<div class="zoom">')
    assert n_graphs >= 3 and f"{n_graphs} graphs shown" in check.group(2)
    # the layer views link every box to its node-level drawing, which exists
    links = set(re.findall(r'xlink:href="([^"#]+\.svg)"', page))
    assert links and all((out / link).exists() for link in links), \
        sorted(link for link in links if not (out / link).exists())
    shot = out / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri())
    assert shot.exists() and shot.stat().st_size > 20_000
    keep = os.environ.get("FXPAR_REPORT_SCREENSHOT")  # e.g. docs/report.png, for reviewers
    if keep:
        shutil.copy(shot, keep)
