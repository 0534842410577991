"""The command line (help, --version, errors a new user meets, the default model), the
FXPAR_LOGS switch, the chosen-plan log line, and compile_times adding up to the wall time."""
import argparse
import logging
import subprocess
import sys
import time

import pytest
import torch

import fxpar
from fxpar.__main__ import main, parser
from fxpar.core import logs
from fxpar.examples import models as M


@pytest.fixture
def fresh_logs(monkeypatch):
    """Each test configures from its own environment; the defaults come back after."""
    monkeypatch.delenv("FXPAR_LOGS", raising=False)
    monkeypatch.delenv("FXPAR_DEBUG", raising=False)
    yield monkeypatch
    monkeypatch.undo()
    top = logging.getLogger("fxpar")
    if logs._handler in top.handlers:
        top.removeHandler(logs._handler)
    logs.configure(force=True)


def _run_cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "fxpar", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_every_option_of_every_subcommand_has_help():
    ap = parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"demo", "viz", "plan", "zoo"}
    missing = [(name, a.dest) for name, p in [("fxpar", ap), *subs.choices.items()]
               for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and not (a.help and a.help != argparse.SUPPRESS)]
    assert not missing, missing
    text = subs.choices["plan"].format_help()
    assert "(default: 8)" in text and "(default: gpt2)" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("fxpar 0.") and f"torch {torch.__version__}" in out


@pytest.mark.slow  # (make test's 6 minutes)
def test_a_factory_that_cannot_be_imported_is_one_line_without_traceback(tmp_path):
    r = _run_cli(tmp_path, "plan", "--model", "nosuch_pkg_xyz.models:make")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    assert "cannot import module 'nosuch_pkg_xyz.models'" in r.stderr
    assert "ModuleNotFoundError" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_factory_errors_name_the_factory(tmp_path, monkeypatch):
    (tmp_path / "fac_mod.py").write_text(
        "def boom():\n    raise RuntimeError('no weights here')\n"
        "def three():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, says in [("fac_mod:boom", "fac_mod.boom() raised RuntimeError: no weights here"),
                       ("fac_mod:three", "must return (model, example_batch"),
                       ("fac_mod:nothere", "has no callable 'nothere'"),
                       ("fac_mod", None)]:  # no ':': not a built-in name either
        with pytest.raises(SystemExit) as e:
            main(["plan", "--model", spec])
        assert (says or "unknown model 'fac_mod'") in str(e.value.code), e.value.code


def test_a_factory_building_on_the_meta_device_plans(tmp_path, monkeypatch, capsys):
    """A model too large to build is built on the meta device, its example batch made
    under the fake mode `fxpar plan` runs the factory in: both traced in one fake mode (the
    meta weights' stand-ins were made in another, and tracing refused the mix)."""
    (tmp_path / "meta_fac.py").write_text(
        "import torch\n"
        "from fxpar.examples import models as M\n"
        "def make():\n"
        "    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)\n"
        "    with torch.device('meta'):\n"
        "        model = M.GPT(cfg)\n"
        "    return model, M.gpt_batch(cfg, 8)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["plan", "--model", "meta_fac:make", "--devices", "2", "--top", "1"])
    out = capsys.readouterr().out
    assert "legal plans for 2 x" in out and "   1  dp=" in out, out


def test_a_factory_traced_a_few_blocks_deep_plans_at_its_depth(tmp_path, monkeypatch, capsys):
    """--depth: a factory building 4 of a model's 48 blocks is priced at 48 (one traced
    block standing for each: the note says so), more parameters than the 4 traced; a model
    with too few blocks to repeat, or --depth with a built-in GPT, says why."""
    (tmp_path / "deep_fac.py").write_text(
        "from fxpar.examples import models as M\n"
        "def make(n=4):\n"
        "    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=n, n_head=2, n_embd=32)\n"
        "    return M.GPT(cfg), M.gpt_batch(cfg, 8)\n"
        "def one():\n"
        "    return make(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["plan", "--model", "deep_fac:make", "--devices", "2", "--top", "1",
          "--depth", "48"])
    out = capsys.readouterr().out
    assert "of 48 repeated blocks" in out and "   1  dp=" in out, out
    with pytest.raises(SystemExit, match="--depth 48: no repeated blocks"):
        main(["plan", "--model", "deep_fac:one", "--devices", "2", "--depth", "48",
              "--keep-first", "1"])
    for bad, said in ((["--model", "small", "--depth", "48"], "scale a --model pkg"),
                      (["--model", "deep_fac:make", "--depth", "2", "--keep-first", "2"],
                       "must exceed --keep-first 2"),
                      (["--model", "deep_fac:make", "--keep-first", "2"],
                       "--keep-first goes with --depth")):
        with pytest.raises(SystemExit):
            main(["plan", *bad])
        assert said in capsys.readouterr().err, bad


def test_fix_degrees_that_do_not_divide_the_devices_say_so():
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "small", "--devices", "8", "--fix", '{"tp": 3}'])
    msg = str(e.value.code)
    assert "tp=3 does not divide 8 devices" in msg and "product divides 8" in msg
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "small", "--devices", "8", "--fix", '{"dp": 4, "tp": 4}'])
    assert "dp=4 x tp=4 (= 16) does not divide 8 devices" in str(e.value.code)


def test_fix_that_is_not_json_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "small", "--fix", "{tp: 3}"])
    assert e.value.code == 2 and "--fix '{tp: 3}' is not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "small", "--fix", '{"tq": 3}'])
    assert "unknown Plan field(s) ['tq']" in str(e.value.code)


def test_bare_plan_plans_gpt2_small_on_8_devices(capsys):
    main(["plan", "--top", "2"])
    out = capsys.readouterr().out
    assert "legal plans for 8 x A100" in out and "of 12 repeated blocks" in out


def test_fxpar_logs_parsing():
    P = logs.parse
    assert P("+planner,passes,-runtime") == {
        "fxpar.compiler.planner": logging.DEBUG, "fxpar.passes": logging.INFO,
        "fxpar.compiler.pass_manager": logging.INFO, "fxpar.runtime": logging.ERROR}
    assert P("all") == {"fxpar": logging.INFO} and P("+all") == {"fxpar": logging.DEBUG}
    assert P("-all") == {"fxpar": logging.ERROR}
    assert P("passes.remat, +fxpar.runtime.pipeline") == {
        "fxpar.passes.remat": logging.INFO, "fxpar.runtime.pipeline": logging.DEBUG}
    with pytest.raises(ValueError, match="unknown component 'planer'"):
        P("planer")


def test_configure_sets_levels_from_the_env_and_by_rank(fresh_logs):
    fresh_logs.setenv("FXPAR_LOGS", "+passes.remat,-runtime")
    logs.configure(force=True)
    lvl = {n: logging.getLogger(n).level for n in ("fxpar", "fxpar.passes.remat",
                                                   "fxpar.runtime")}
    assert lvl == {"fxpar": logging.WARNING, "fxpar.passes.remat": logging.DEBUG,
                   "fxpar.runtime": logging.ERROR}
    fresh_logs.delenv("FXPAR_LOGS")
    root = logging.getLogger()
    fresh_logs.setattr(root, "handlers", [logging.NullHandler()])  # the program's config:
    logs.configure(force=True)  # the spec's levels undone, no level forced on "fxpar"
    assert logging.getLogger("fxpar").level == logging.NOTSET
    assert logging.getLogger("fxpar.runtime").level == logging.NOTSET
    fresh_logs.setattr(root, "handlers", [])  # a program that configured no logging
    fresh_logs.setenv("RANK", "1")  # default: WARNING off rank 0, levels of the spec undone
    logs.configure(force=True)
    assert logging.getLogger("fxpar").level == logging.WARNING
    assert logging.getLogger("fxpar.passes.remat").level == logging.NOTSET
    rec = logging.LogRecord("fxpar.api.parallelize", logging.INFO, __file__, 1, "hi", (), None)
    assert logs._Format().format(rec) == "[rank 1] fxpar: hi"
    fresh_logs.setenv("RANK", "0")
    logs.configure(force=True)
    assert logging.getLogger("fxpar").level == logging.INFO
    assert logs._Format().format(rec) == "fxpar: hi"


def test_one_handler_on_fxpar_only_and_a_users_config_wins(fresh_logs):
    root, top = logging.getLogger(), logging.getLogger("fxpar")
    fresh_logs.setattr(root, "handlers", [])  # a program that configured no logging
    before = list(top.handlers)
    logs.configure(force=True)
    logs.configure(force=True)
    added = [h for h in top.handlers if h not in before]
    assert added == [logs._handler] and not root.handlers
    top.removeHandler(logs._handler)
    mine = logging.NullHandler()  # the program's own: fxpar adds nothing, keeps its level
    fresh_logs.setattr(top, "handlers", [mine])
    fresh_logs.setattr(logs, "_levels_set", set())
    fresh_logs.setattr(top, "level", logging.ERROR)
    logs.configure(force=True)
    assert top.handlers == [mine] and top.level == logging.ERROR


def test_auto_plan_logs_the_choice_and_the_runner_up(caplog, fresh_logs):
    cfg = M.GPTConfig()
    with caplog.at_level(logging.INFO, logger="fxpar"):
        prog = fxpar.compile(M.GPT(cfg), 2, example_batch=M.gpt_batch(cfg, 4),
                             plan={"dp": "auto", "tp": "auto"})
    text = caplog.text
    assert "plan chosen: dp=" in text and "ms/step" in text and "/device" in text
    assert "runner-up dp=" in text and "compiled in" in text
    names = [n for n, _, _ in prog.compile_times]
    assert names[:2] == ["planner: trace model", "planner: measure machine"]
    assert "planner: search" in names and names[-1] == "other"


@pytest.mark.parametrize("how", ["parallelize", "compile"])
def test_compile_times_add_up_to_the_wall_time(how):
    cfg = M.GPTConfig()
    torch.manual_seed(0)
    model, batch = M.GPT(cfg), M.gpt_batch(cfg, 4)
    call = getattr(fxpar, how)  # (its first use imports the library's modules: not the call's)
    t = time.perf_counter()
    if how == "parallelize":
        rows = call(model, 1, example_batch=batch, plan={"dp": "auto"}).compile_times
    else:
        rows = call(model, 2, example_batch=batch, plan="auto").compile_times
    wall = time.perf_counter() - t
    total = sum(s for _, s, _ in rows)
    assert abs(total - wall) <= max(0.05 * wall, 0.05), (total, wall, rows)
    names = [n for n, _, _ in rows]
    assert {"capture", "verify capture", "data_parallel", "other"} <= set(names)
    if how == "parallelize":
        assert {"comm lowering", "optimizer"} <= set(names)
    assert all(s >= 0 for _, s, _ in rows)


def test_a_long_phase_prints_a_progress_line(caplog):
    log = logging.getLogger("fxpar.compiler.planner")
    with caplog.at_level(logging.DEBUG, logger="fxpar"):
        logs.phase_done(log, "planner search", 4.1, "12 plans priced")
        logs.phase_done(log, "pass remat", 0.01)
    recs = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert recs == [(logging.INFO, "planner search 4.1 s (12 plans priced)"),
                    (logging.DEBUG, "pass remat 10.0 ms")]


def test_a_long_phase_says_what_runs_before_it_ends_and_a_short_one_stays_quiet(monkeypatch,
                                                                                caplog):
    monkeypatch.setattr(logs, "PROGRESS_S", 0.05)
    log = logging.getLogger("fxpar.test_announce")
    with caplog.at_level(logging.INFO, logger="fxpar.test_announce"):
        with logs.announce(log, "capturing Big's forward + backward"):
            time.sleep(0.3)
            assert "capturing Big's forward + backward ..." in caplog.text  # while it runs
        with logs.announce(log, "short"):
            pass
        time.sleep(0.2)  # (the short phase's timer was cancelled: it never prints)
    assert "short" not in caplog.text


def test_the_plan_table_says_what_it_hides_and_shows_no_cpu_mfu():
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.compiler.compile import planner_stats
    stats = planner_stats(M.MLP(), (torch.randn(8, 16), torch.randn(8, 4)), None)
    r = planner.search(stats, 4, cost.cpu_hardware(), batch_rows=8)
    assert len(r.table) > 2
    text = r.format(2)
    assert f"and {len(r.table) - 2} more ranked plans" in text
    assert "MFU     -" in text and "%" not in text.split("MFU")[1][:8]
    assert r.best.mfu is None
    gpu = planner.search(stats, 4, cost.HARDWARE["h100"], batch_rows=8)
    assert 0 < gpu.best.mfu < 1 and "MFU: GPUs only" not in gpu.format()
