"""Bad input gets a clear exception; a failing rank ends every rank, never a hang."""
import copy
import os
import re
import subprocess
import sys
import time
import types

import pytest
import torch

import fxpar
from fxpar.examples import models as M


def _mlp():
    return M.MLP(), (torch.randn(8, 16), torch.randn(8, 4))


def test_world_size_must_match_plan():
    model, batch = _mlp()
    with pytest.raises(fxpar.PlanError, match="world size 1 does not match the plan"):
        fxpar.parallelize(model, 1, example_batch=batch, plan={"dp": 2})


def test_unknown_plan_field():
    model, batch = _mlp()
    with pytest.raises(fxpar.PlanError, match=r"unknown Plan field\(s\) \['dpp'\]"):
        fxpar.parallelize(model, 1, example_batch=batch, plan={"dpp": 1})


def test_zero3_composes_with_tp_pp_and_microbatches():
    """Once refused (not implemented), now plans like any other (tests/test_weights.py runs
    them against eager)."""
    fxpar.Plan(dp=2, tp=2, pp=1, zero=3).validate(4)
    fxpar.Plan(dp=2, tp=1, pp=2, zero=3, microbatches=2).validate(4)
    fxpar.Plan(dp=2, tp=1, pp=1, zero=3, microbatches=2).validate(2)


@pytest.mark.slow  # (make test's 6 minutes)
def test_multi_rank_devices_without_launcher():
    model, batch = _mlp()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    code = ("import torch, fxpar; from fxpar.examples.models import MLP\n"
            "fxpar.parallelize(MLP(), 2, example_batch=(torch.randn(8,16), torch.randn(8,4)))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "torchrun --nproc-per-node 2" in r.stderr


def test_loss_fn_returning_non_scalar():
    model, batch = _mlp()
    with pytest.raises(fxpar.TraceError, match="scalar"):
        fxpar.parallelize(model, 1, example_batch=batch,
                          loss_fn=lambda m, b: (m.fc3(m.fc1(b[0]).relu() @ m.fc2.weight) ** 2))


def test_step_batch_structure_must_match_example():
    model, batch = _mlp()
    pm = fxpar.parallelize(model, 1, example_batch=batch)
    with pytest.raises(fxpar.BatchError, match="structure"):
        pm.step({"x": batch[0], "y": batch[1]})
    with pytest.raises(fxpar.BatchError, match="example_batch had"):
        pm.step((torch.randn(4, 16), torch.randn(4, 4)))


def test_untraceable_model_via_parallelize():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).mean() if self.fc(x).sum().item() > 0 else self.fc(x).sum()

    with pytest.raises(fxpar.TraceError, match="data-dependent"):
        fxpar.parallelize(Bad(), 1, example_batch=torch.randn(2, 4))


def test_an_op_whose_output_shape_depends_on_values_is_named_with_its_line():
    """ctc_loss has no fake-tensor kernel of a fixed shape (torch's DynamicOutputShape):
    the error names the op and the user's line (it blamed data-dependent control flow in
    general; found by a zoo sweep on HF Wav2Vec2 with CTC)."""
    class CTC(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 5)

        def forward(self, batch):
            x, y = batch
            lp = self.lin(x).log_softmax(-1).transpose(0, 1)
            return torch.nn.functional.ctc_loss(lp, y, [10] * 4, [3] * 4)

    batch = (torch.randn(4, 10, 8), torch.randint(1, 5, (4, 3)))
    with pytest.raises(fxpar.TraceError, match=r"_ctc_loss.*shape depends on tensor values, "
                                               r"at .*test_errors.py:\d+: return torch.nn"):
        fxpar.compile(CTC(), 1, example_batch=batch)


def test_a_failed_parallelize_frees_what_it_made_while_the_exception_is_kept(monkeypatch):
    """parallelize fails after compiling (here: the runtime's set-up raises): the Program
    and its graphs are freed although the caller keeps the exception (as a notebook keeps
    sys.last_value), so a retry or eager PyTorch after it has the memory back."""
    import weakref
    from fxpar.api import parallelize as api
    made = []

    def failing_runtime(model, world, program, *args, **kwargs):
        made.append(weakref.ref(program))
        made.append(weakref.ref(program.graph))
        del program
        raise RuntimeError("injected failure in the runtime's set-up")
    monkeypatch.setattr(api, "ParallelModel", failing_runtime)
    model = M.GPT(M.GPTConfig(n_layer=1, n_embd=32))
    with pytest.raises(RuntimeError, match="injected") as kept:
        fxpar.parallelize(model, 1, example_batch=M.gpt_batch(M.GPTConfig(n_layer=1), 2))
    assert made and all(ref() is None for ref in made), "the Program outlived the failure"
    assert kept.value is not None


def test_out_of_memory_in_parallelize_names_the_phase_and_what_to_try(monkeypatch):
    from fxpar.runtime import calls

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(calls, "register", oom)
    with pytest.raises(torch.OutOfMemoryError) as e:
        fxpar.parallelize(M.GPT(M.GPTConfig(n_layer=1, n_embd=32)), 1,
                          example_batch=M.gpt_batch(M.GPTConfig(n_layer=1), 2))
    note = "\n".join(e.value.__notes__)
    assert "while setting up the runtime" in note and "remat='auto'" in note, note
    assert "ZeRO" in note and "smaller" in note, note


def _what_a_rank_sees():
    return (os.environ.get("FXPAR_TEST_SET_LATER"), os.getcwd(), sys.path[-1],
            os.environ["RANK"], torch.get_num_threads())


def test_launched_ranks_see_the_callers_environment_directory_and_path(tmp_path, monkeypatch):
    """The ranks are forked from a server that imported torch and fxpar once: what the caller
    changed after the server started (an environment variable, the working directory,
    sys.path, OMP_NUM_THREADS) still reaches them, and each keeps its own RANK."""
    fxpar.launch(_what_a_rank_sees, 2)  # the server starts (if no earlier test started it)
    monkeypatch.setenv("FXPAR_TEST_SET_LATER", "yes")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", sys.path + ["/a/path/added/later"])
    t = time.perf_counter()
    seen = fxpar.launch(_what_a_rank_sees, 2)
    took = time.perf_counter() - t
    assert seen == {r: ("yes", str(tmp_path), "/a/path/added/later", str(r), 1) for r in (0, 1)}
    from fxpar.runtime import dist
    if dist._start_method() == "forkserver":
        assert took < 5.0, took  # no import of torch per rank (8-10 s on 2 cores when spawned)


def test_ranks_fork_with_the_callers_model_libraries_loaded():
    """The forkserver imports the modules of the model libraries the caller had loaded
    (runtime/preload.py; tests/conftest imports the HF models the tests launch before the
    first launch): a rank finds them loaded without importing them. The list holds the
    leaves (a package comes with its modules) of those libraries only; a module that does
    not import in a fresh process is skipped, the rest still load (a library that does not
    import at all: its other modules not tried)."""
    from fxpar.runtime import dist
    pytest.importorskip("transformers.models.gpt2.modeling_gpt2")  # (loaded by the caller)
    names = dist._model_library_modules().split(",")
    assert "transformers.models.gpt2.modeling_gpt2" in names
    assert "transformers" not in names and "transformers.models" not in names  # (parents)
    assert all(n.partition(".")[0] in dist.MODEL_LIBRARIES for n in names)
    if dist._start_method() == "forkserver":
        seen = fxpar.launch(eval, 2, "'transformers.models.gpt2.modeling_gpt2' in "
                                     "__import__('sys').modules")
        assert seen == {0: True, 1: True}
    code = ("import sys; import fxpar.runtime.preload as p; "
            "print('email.mime.text' in sys.modules, 'json' in sys.modules, sorted(p._failed))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "FXPAR_PRELOAD": "json,no_such_library.x,"
                              "no_such_library.y,email.nope,email.mime.text"}, check=True)
    assert out.stdout.split() == ["True", "True", "['no_such_library']"]


@pytest.mark.slow
def test_launch_reports_failing_rank():
    from workers import failing_rank
    with pytest.raises(fxpar.FxparError, match=r"rank 1 failed.*injected failure at step 2"):
        fxpar.launch(failing_rank, 2, 1, 2)


@pytest.mark.slow
def test_rank_raising_mid_step_ends_all_ranks_without_hang(tmp_path):
    """Raw processes (no elastic agent watching them): the survivor's collective must fail
    on its own, within the group timeout, with a non-zero exit."""
    timeout_s = 30
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               FXPAR_TIMEOUT=str(timeout_s), FXPAR_DEVICE="cpu")
    tests_dir = os.path.dirname(__file__)
    code = (f"import sys; sys.path.insert(0, {tests_dir!r}); from workers import failing_rank; "
            "failing_rank(1, 2)")
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r),
                              LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    codes = [p.wait(timeout=timeout_s + 90) for p in procs]
    assert all(c != 0 for c in codes), codes
    assert time.time() - t0 < timeout_s + 90
    assert b"injected failure at step 2" in procs[1].stderr.read()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # (a 2-process launch, 5 s)
def test_zero_refuses_an_optimizer_instance():
    from workers import zero_with_optimizer_instance
    with pytest.raises(fxpar.runtime.dist.LaunchError, match="pass a factory"):
        fxpar.launch(zero_with_optimizer_instance, 2)


# --- faults under real processes (runtime/faults.py) -------------------------------------------

def _spawn_raw(code, world, timeout_s, token, logs):
    """`world` raw rank processes (no launcher watching them), as torchrun's workers run."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), FXPAR_TIMEOUT=str(timeout_s), FXPAR_DEVICE="cpu",
               OMP_NUM_THREADS="1")
    tests_dir = os.path.dirname(__file__)
    src = f"import sys; sys.path.insert(0, {tests_dir!r}); import workers; {code}  # {token}"
    procs = []
    for r in range(world):  # output to files: a full pipe would block a rank that is exiting
        log = open(f"{logs}.rank{r}.log", "w+")
        procs.append(subprocess.Popen([sys.executable, "-c", src], env=dict(
            env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log, stderr=subprocess.STDOUT))
        procs[-1].log = log
    return procs


def _live_children():
    """The ranks still running: this process's children and those of its fork server (the
    ranks' parent), multiprocessing's resource tracker and fork server aside."""
    procs = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                procs[int(pid)] = (int(fields[1]), fields[0], f.read())
        except (OSError, ValueError):
            continue
    helpers = {pid for pid, (ppid, _, cmd) in procs.items() if ppid == os.getpid()
               and (b"resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd)}
    out = []
    for pid, (ppid, state, cmd) in procs.items():
        if ppid in {os.getpid(), *helpers} and pid not in helpers and state != "Z":
            out.append((pid, cmd[:200]))
    return out


def _leftovers(token):
    """Processes still running whose command line carries `token`."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.full  # (four jobs, one on 4 ranks, waiting out a 10 s timeout: CI's 2 cores)
def test_faults_under_real_processes(tmp_path):
    """Raw rank processes with FXPAR_TIMEOUT=10 (all four jobs at once):
    - kill: rank 1 is SIGKILLed 5 ms into step 3 -> rank 0 raises RankFailure naming rank 1,
      its death and the step, within the timeout;
    - raise: rank 1's step 3 raises (BatchError) -> it exits with that error (noted with its
      rank and step), rank 0 raises RankFailure quoting it;
    - hang: rank 1 stops answering before step 3 -> the other ranks' step-3 call check
      (runtime/calls.py: every rank agrees it is stepping) times out after FXPAR_TIMEOUT, and
      every other rank raises RankFailure ("no other rank reported an error").
    No process is left running."""
    import uuid
    timeout_s = 10
    token = f"fxpar-fault-{uuid.uuid4().hex[:8]}"
    jobs = {case: _spawn_raw(f"workers.fault_rank({case.split('-')[0]!r}, plan={plan!r})", world,
                             timeout_s, token, tmp_path / case)
            for case, plan, world in (("kill", {}, 2), ("raise", {}, 2), ("hang-pp", {"pp": 2}, 2),
                                      ("hang-tp", {"dp": 2, "tp": 2}, 4))}
    t0 = time.time()
    results = {}
    for mode, procs in jobs.items():
        rank0 = procs[0]
        try:
            rank0.wait(timeout=300 - (time.time() - t0))
        finally:
            t_end = time.time()
            if mode.startswith("hang"):  # the hung rank sleeps on: the job's supervisor ends it
                procs[1].kill()
            for p in procs:
                p.wait(timeout=60)
        logs = []
        for p in procs:
            p.log.seek(0)
            logs.append(p.log.read())
            p.log.close()
        results[mode] = ([p.returncode for p in procs], *logs, t_end - t0)
    codes, err0, _, _ = results["kill"]
    assert codes[0] != 0 and codes[1] == -9, codes
    # (the kill lands 2 ms into step 3: rank 0 is in step 3, or 4 if rank 1's step was quicker)
    assert re.search(r"fxpar.core.errors.RankFailure: step [34] stopped on rank 0 of 2: "
                     r"rank 1 died \(its process \d+ is gone", err0), err0[-3000:]
    codes, err0, err1, _ = results["raise"]
    assert codes[0] != 0 and codes[1] != 0
    assert "BatchError" in err1 and "raised on rank 1 at step 3" in err1, err1[-3000:]
    assert "RankFailure: step 3 stopped on rank 0 of 2: rank 1 raised at step 3: BatchError" in err0, err0[-3000:]
    codes, err0, _, _ = results["hang-pp"]  # step 3's call check (runtime/calls.py) timed out
    assert codes[0] != 0
    assert "RankFailure: step 3 stopped on rank 0 of 2: no other rank reported an error" in err0, err0[-3000:]
    assert "FXPAR_TIMEOUT=10" in err0 and "Timed out waiting 10000ms" in err0, err0[-2000:]
    codes, err0, _, err2, err3, _ = results["hang-tp"]  # a tp sub-group collective timed out
    assert codes[0] != 0 and codes[2] != 0 and codes[3] != 0, codes
    assert "RankFailure: step 3 stopped on rank 0 of 4: no other rank reported an error" in err0, err0[-3000:]
    assert "Timed out waiting 10000ms" in err0
    assert "RankFailure: step 3 stopped on rank 2 of 4" in err2 and "RankFailure" in err3
    assert not _leftovers(token)


@pytest.mark.slow
def test_launch_names_killed_rank_and_step_and_nan_loss():
    """fxpar.launch (torch's elastic agent): a SIGKILLed rank ends the job with LaunchError
    naming the rank, the signal and the step; a NaN loss (FXPAR_DEBUG_NAN=1) raises on every
    rank with the step and the first non-finite node."""
    from workers import fault_rank, nan_rank
    t0 = time.time()
    with pytest.raises(fxpar.runtime.dist.LaunchError,
                       match=r"rank 1 failed \(killed by SIGKILL, its last pm.step begun: "
                             r"step \d+\)") as err:
        fxpar.launch(fault_rank, 2, "kill")
    # the timer is armed just before step 3 and fires 2 ms later: the last step begun is 2
    # (killed before step 3 recorded itself), 3, or later (this MLP's steps take milliseconds)
    assert int(re.search(r"step (\d+)\)", str(err.value)).group(1)) >= 2
    assert time.time() - t0 < 120
    assert not _live_children()  # the agent ended rank 0 too
    with pytest.raises(fxpar.runtime.dist.LaunchError,
                       match=r"NonFiniteLossError: step 2: the loss is nan.*rank 1: node log "
                             r"\(aten.log.default, module 'act', forward\) made nan"):
        fxpar.launch(nan_rank, 2)


def test_nan_loss_raises_with_step_and_first_node(monkeypatch):
    from workers import LogNet
    pm = fxpar.parallelize(LogNet(), 1, example_batch=torch.ones(4, 4))
    pm.step(torch.ones(4, 4))
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    bad = torch.ones(4, 4)
    bad[0] = -5.0
    with pytest.raises(fxpar.NonFiniteLossError, match=r"step 2: the loss is nan.*FXPAR_DEBUG_NAN"):
        pm.step(bad)
    assert all(torch.equal(before[k], v) for k, v in pm.full_state_dict().items())  # not applied
    monkeypatch.setenv("FXPAR_DEBUG_NAN", "1")
    with pytest.raises(fxpar.NonFiniteLossError,
                       match=r"step 2: .*rank 0: node log \(aten.log.default, module 'act', "
                             r"forward\) made nan"):
        pm.step(bad)
    bad = torch.ones(4, 4)
    with torch.no_grad():
        pm.model.fc.weight[0, 0] = float("inf")
    with pytest.raises(fxpar.NonFiniteLossError, match=r"input fc.weight"):
        pm.step(bad)


TORCHRUN_SCRIPT = """
import torch, fxpar
from fxpar.examples import models as M
torch.manual_seed(0)
model = M.MLP()
x, y = torch.randn(8, 16), torch.randn(8, 4)
pm = fxpar.parallelize(model, 2, example_batch=(x, y), plan={"dp": 2})
for _ in range(2):
    pm.step((x, y))
print("trained", flush=True)
"""


@pytest.mark.slow
def test_torchrun_ranks_exit_cleanly(tmp_path):
    """Under torchrun (no fxpar.launch around it) every rank exits 0 after a correct run: the
    process group fxpar opened is destroyed at exit (it aborted 1 run in 4 when left to the
    interpreter's teardown)."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, FXPAR_DEVICE="cpu", OMP_NUM_THREADS="1")
    for _ in range(4):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", str(script)], env=env, capture_output=True,
                           text=True, timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and out.count("trained") == 2, out[-3000:]
        assert "terminate called" not in out, out[-3000:]


JOIN_SCRIPT = """
import os
from fxpar.runtime import dist as rdist
try:
    rdist.launch_or_join(os.getpid, 3)
    refused = "not refused"
except rdist.LaunchError as e:
    refused = str(e)
res = rdist.launch_or_join(lambda: int(os.environ["RANK"]) * 10, 2)
with open(os.path.join(os.path.dirname(__file__), "result" + os.environ["RANK"]), "w") as f:
    f.write(f"{refused}\\n{res!r}")  # (a file per rank: the ranks' prints interleave)
"""


@pytest.mark.slow
def test_launch_or_join_runs_in_torchruns_ranks(tmp_path):
    """A script written for fxpar.launch runs in the ranks torchrun started (the benchmarks'
    way onto several nodes): the values gathered to rank 0, None on the others, and a rank
    count other than torchrun's world refused by name instead of spawning more ranks."""
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    env = dict(os.environ, FXPAR_DEVICE="cpu", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], env=env, capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    refused = "3 ranks were asked for, but torchrun started 2: pass 2"
    for rank, res in ((0, "{0: 0, 1: 10}"), (1, "None")):
        said, got = (tmp_path / f"result{rank}").read_text().split("\n")
        assert said.startswith(refused) and got == res, (said, got)


def _retry_after_refusal():
    from fxpar.core.errors import PlanError
    from fxpar.examples import models as M
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    try:  # (refused by the ep pass, after parallelize opened the process group)
        fxpar.parallelize(model, 2, example_batch=(x, y), plan={"dp": 2, "ep": 2})
    except PlanError as e:
        refused = str(e)
    pm = fxpar.parallelize(model, 2, example_batch=(x, y), plan={"dp": 2})
    return refused, pm.step((x, y)).item()


@pytest.mark.slow
def test_parallelize_again_after_a_refusal_in_the_same_launch():
    """A parallelize refused after it opened the process group closes it; the next one in the
    same ranks opens a new group and trains (it once read the closed group's addresses from
    the launcher's store and failed: "Connection refused")."""
    res = fxpar.launch(_retry_after_refusal, 2)
    for refused, loss in res.values():
        assert "no MoE layer" in refused and loss == loss
    assert res[0][1] == res[1][1]


# --- errors in the user's terms (issue 45) ------------------------------------------------------

class _Tagger(torch.nn.Module):
    """batch = (ids [B, T], labels [B]): embedding, mean over T, 5-class cross-entropy."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, batch):
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids).mean(1)), labels)


def test_an_out_of_range_id_or_target_names_the_op_module_and_cause():
    """An id >= the table's rows or a target outside [0, classes) raised ATen's bare
    `IndexError: index out of range in self` (Inductor: `index out of bounds: 0 <= tmp2 <
    4096L`, or an abort) from inside the runtime: now the op, its module and the cause -
    checked before the first step, and after a later step raised."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 16, (4, 6)), torch.randint(0, 5, (4,))
    pm = fxpar.parallelize(_Tagger(), 1, example_batch=(ids, labels), plan={"codegen": "eager"})
    bad_ids = ids.clone()
    bad_ids[2, 3] = 16
    with pytest.raises(fxpar.BatchError, match=r"step 1: aten\.embedding in module 'emb': "
                       r"embedding ids must be in \[0, 16\) .*batch\[0\] holds 16 \(1 of 24 "
                       r"values.*larger than the model's table") as e:
        pm.step((bad_ids, labels))
    assert isinstance(e.value, IndexError)  # (what eager raises: except IndexError still works)
    ignored = labels.clone()
    ignored[0] = -100  # cross-entropy's ignore_index is in range
    pm.step((ids, ignored))
    bad_labels = labels.clone()
    bad_labels[1] = 7
    with pytest.raises(fxpar.BatchError, match=r"step 2: aten\.nll_loss_forward in the model's "
                       r"top-level forward \(or the loss\): cross-entropy targets must be class "
                       r"indices in \[0, 5\) .* or ignore_index=-100, but batch\[1\] holds 7 "
                       r".*Check the labels") as e:
        pm.step((ids, bad_labels))
    assert isinstance(e.value.__cause__, IndexError)  # found after the run raised
    assert pm.step((ids, labels)).isfinite()


def test_the_index_check_reads_through_shifted_ids_and_the_fused_cross_entropy():
    """The check evaluates the batch-only part of the graph: ids shifted and masked into one
    rank's rows (tp's vocabulary-parallel lookup) pass; the codegen cross-entropy's gather of
    where(target != ignore_index, target, 0) is named as a target check; Inductor's
    bounds-check message counts as an index error, a collective's failure does not."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from fxpar.runtime import index_check

    def f(w, ids, logits, t):
        local = ids - 8
        safe = local.masked_fill((local < 0) | (local >= 8), 0)
        keep = t != -100
        picked = torch.gather(logits, 1, torch.where(keep, t, 0).unsqueeze(1))
        return torch.nn.functional.embedding(safe, w), picked

    w, logits = torch.randn(8, 4), torch.randn(3, 5)
    ids, t = torch.tensor([[0, 9, 15]]), torch.tensor([4, -100, 0])
    gm = make_fx(f)(w, ids, logits, t)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert index_check.bad_index(gm, {ph[1]: (ids, "['ids']"), ph[3]: (t, "['labels']")}) is None
    said = index_check.bad_index(gm, {ph[1]: (ids, "['ids']"),
                                      ph[3]: (torch.tensor([4, 9, -100]), "['labels']")})
    assert "aten.gather" in said and "cross-entropy targets must be class indices in [0, 5)" \
        in said and "ignore_index=-100" in said and "batch['labels'] holds 9" in said, said
    assert index_check.is_index_error(RuntimeError(
        "kernel, /tmp/x.main.cpp:21, index out of bounds: 0 <= tmp2 < 4096L"))
    assert not index_check.is_index_error(RuntimeError("gloo: connection closed by peer"))


def test_a_tuple_batch_for_a_forward_of_several_arguments_names_the_fix():
    """The default loss calls model(batch): a forward(x, y) got the whole tuple as x and the
    TraceError blamed data-dependent control flow; now it names the cause and
    loss_fn=lambda m, b: m(*b)."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, x, y=None):
            out = self.fc(x)
            return out if y is None else torch.nn.functional.mse_loss(out, y)

    batch = (torch.randn(8, 16), torch.randn(8, 4))
    with pytest.raises(fxpar.TraceError, match=r"default loss calls model\(batch\) with the "
                       r"whole batch as one argument, but Two\.forward takes the batch's items "
                       r"as separate arguments \(x, y\) .*Fix: pass `loss_fn=lambda m, b: "
                       r"m\(\*b\)`"):
        fxpar.compile(Two(), 1, example_batch=batch)
    fxpar.compile(Two(), 1, example_batch=batch, loss_fn=lambda m, b: m(*b))


def test_print_plan_report_shows_the_table_and_repr_stays_short():
    """print(pm.plan_report) dumped the dataclass's repr: every candidate's fields, one line."""
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.compiler.memory_model import MemoryEstimate

    def candidate(dp, tp, ms):
        plan = fxpar.Plan(dp=dp, tp=tp, pp=1, microbatches=1, zero=0, remat="none")
        return planner.Candidate(plan, ms / 1e3, MemoryEstimate(2 ** 20, 2 ** 20, 2 ** 21,
                                                                2 ** 22, 0), 0.3, 0.0,
                                 {"compute": ms / 1e3 * 0.8, "dp communication": ms / 1e3 * 0.2})

    table = [candidate(2, 1, 1.0), candidate(1, 2, 1.5)]
    report = planner.PlanResult(table[0], table, 2, 2, cost.HARDWARE["a100"], "", 0.1, 2)
    text = str(report)
    assert text.splitlines()[0].startswith("2 legal plans for 2 x ") and "\n   1  dp=2" in text \
        and "\n   2  dp=1" in text and "chosen: dp=2" in text and "runner-up" in text, text
    assert repr(report).startswith("<PlanResult: dp=2 tp=1 pp=1") and "\n" not in repr(report) \
        and len(repr(report)) < 200, repr(report)


def test_warnings_of_a_multi_process_job_carry_the_rank_and_print_once(monkeypatch, capsys):
    """warnings.warn (a pass's "stay whole", torch's own) bypassed the logger's "[rank r]"
    prefix and printed once per rank and repeat; the job's store dedups across ranks (not
    here: no process group, each rank decides alone)."""
    import warnings
    from fxpar.core import logs
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = warnings._showwarning_orig
        logs.configure(force=True)
        for _ in range(3):
            warnings.warn("issue 45: a layer stays whole")
        monkeypatch.setenv("RANK", "0")
        warnings.warn("issue 45: rank 0's")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "UserWarning: issue 45" in ln]
    assert len(lines) == 2 and lines[0].startswith("[rank 1] ") and \
        lines[0].endswith("UserWarning: issue 45: a layer stays whole"), lines
    assert not lines[1].startswith("[") and lines[1].endswith("rank 0's"), lines  # as logs


def _tp_out_of_range_rank():
    """tp=2, vocabulary-parallel table and head: a good step, then an id past the vocabulary,
    then a target past it, then a good step again. Returns what each bad step raised."""
    cfg = M.GPTConfig(n_layer=1)
    torch.manual_seed(0)
    ids, targets = M.gpt_batch(cfg, 8)
    pm = fxpar.parallelize(M.GPT(cfg), 2, example_batch=(ids, targets),
                           plan={"tp": 2, "codegen": "eager"})
    assert any(n.target is torch.ops.fxpar.localize.default for roles in
               pm.stage_graphs.values() for gm in roles.values() for n in gm.graph.nodes)
    pm.step((ids, targets))
    said = []
    for which in (0, 1):
        bad = [ids.clone(), targets.clone()]
        bad[which][3, 5] = cfg.vocab_size
        try:
            pm.step(tuple(bad))
            said.append("no error")
        except IndexError as e:
            said.append(f"{type(e).__name__}: {e}")
    assert pm.step((ids, targets)).isfinite()
    return said


@pytest.mark.slow
def test_an_id_past_the_vocabulary_raises_under_vocab_parallel_tp_after_the_first_step():
    """Split by vocabulary, an id past the table is in no rank's slice: each masked it to
    zero and the step trained on a wrong loss, silently (the first-step check was the only
    guard). fxpar's localize now checks the whole range, as eager's embedding does."""
    said = fxpar.launch(_tp_out_of_range_rank, 2)[0]
    assert all("out of the vocabulary's range [0, " in s for s in said), said


def test_out_of_memory_while_tracing_is_not_blamed_on_control_flow():
    """A CUDA OOM inside tracing was re-raised as a TraceError advising against
    data-dependent control flow: it stays an OutOfMemoryError, with a note on what holds
    the memory and the fix."""
    class Hungry(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError) as e:
        fxpar.compile(Hungry(), 1, example_batch=torch.randn(2, 4))
    said = "\n".join(getattr(e.value, "__notes__", []))
    assert "ran out of memory while tracing" in said and "meta device" in said
    assert "data-dependent" not in str(e.value) + said


class _CopiesItsCache(torch.nn.Module):
    """A Hugging Face-like model whose forward deep-copies the KV cache it builds
    (Inkling-2-Loop's), with its config's use_cache=True."""

    def __init__(self, use_cache=True):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.config = types.SimpleNamespace(use_cache=use_cache)

    def forward(self, x):
        y = self.lin(x)
        if self.config.use_cache:
            copy.deepcopy([y.detach()])
        return y.sum()


def test_a_trace_failing_with_a_kv_cache_says_to_turn_it_off():
    with pytest.raises(fxpar.TraceError, match="use_cache=True.*model.config.use_cache = False"):
        fxpar.compile(_CopiesItsCache(), 1, example_batch=torch.randn(2, 4),
                      loss_fn=lambda m, b: m(b))
    fxpar.compile(_CopiesItsCache(use_cache=False), 1, example_batch=torch.randn(2, 4),
                  loss_fn=lambda m, b: m(b))
