"""Compile time: capture (AOTAutograd's joint trace) and the passes, HF GPT-2 at 768 wide.

    python benchmarks/compile_time.py [--layers 2,12,48] [--seq 128]

Prints, per depth, the seconds of capture and of the passes (one device, fusion off: the
CPU path) and the milliseconds per graph node, so a cost that grows faster than the graph
shows as a rising ms/node; then the same capture tracing every block (repeated blocks not
stamped: compiler/repeated_blocks.py) and the ratio. docs/benchmarks.md records the figures.

    python benchmarks/compile_time.py --vs-torch [--layers 12,48]

Capture alone, every block traced (repeated blocks not stamped), fxpar's one-trace joint
export (compiler/capture._export_joint) against torch's aot_export_module(trace_joint=True),
which traces the joint graph a second time on the real weights and batch: both in one
process, interleaved, with their ratio.

    python benchmarks/compile_time.py --per-block [--layers 12] [--width 256]

The compiled joint graph's forward+backward time with runs cut per repeated block (the
default) against runs spanning layers, interleaved in one process, with the ratio.

    python benchmarks/compile_time.py --zoo-stamped 8

Every zoo model rebuilt at that depth: its capture with repeated blocks stamped against the
capture tracing every block, compared node for node, and whether (or why not) it stamped.

    python benchmarks/compile_time.py --to-first-step [--layers 12,48]

What a user waits for: `parallelize` and the first step's extra time over a steady step
(its first-call checks), one device, the CPU default plan (Inductor), on the Qwen2-style LM
of benchmarks/first_steps.py; per depth a first job (each in a fresh process, an empty
cache) and a later job (a fresh process, that cache), with the ratio to the first depth's.

    python benchmarks/compile_time.py --ranks 4 [--layers 12]

A job's compile on N CPU ranks (fxpar.launch, gloo): fxpar.parallelize, which compiles on
rank 0 and sends the Program to the others, against every rank compiling it at once
(fxpar.compile on each rank, the same plan), each run a fresh launch, interleaved, median
of 3: the seconds until every rank holds the Program.

    python benchmarks/compile_time.py --codegen [--layers 12]

Code generation (Plan.codegen="inductor", compiler/codegen.py) of the one-device joint
graph: two fresh processes sharing one empty cache directory (TORCHINDUCTOR_CACHE_DIR, which
holds fxpar's cache too): the first compiles every run with Inductor, the second - a later
job - loads them. Prints both times and their ratio; then a first job with runs spanning
layers (`generate(per_block=False)`) in another empty cache.
"""
from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def gpt2(layers: int, seq: int, width: int = 768):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=12, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def codegen_child(layers: int, seq: int, per_block: bool = True) -> None:
    """One job's code generation of the joint graph; prints seconds, runs, cache hits."""
    import time

    import fxpar
    from fxpar.compiler import codegen
    torch.manual_seed(0)
    model = gpt2(layers, seq)
    ids = torch.randint(0, 50257, (2, seq))
    prog = fxpar.compile(model, 1, example_batch={"input_ids": ids, "labels": ids},
                         plan={"fuse": False, "codegen": "inductor"})
    t0 = time.perf_counter()
    gm = codegen.generate(prog.graph, "cpu", "joint", per_block=per_block)
    d = gm.meta["codegen"]
    loaded = sum(r.cached or r.reused for r in d.runs)  # runs not compiled by this job
    print(f"RESULT {time.perf_counter() - t0:.2f} {len(d.runs)} {loaded}")


def codegen_times(layers: list[int], seq: int) -> None:
    """Per depth: a first job and a later one sharing its cache, per repeated block (the
    default); and a first job with runs spanning layers (each in an empty cache)."""
    import subprocess
    import sys
    import tempfile

    def job(n, cache, *extra):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        env.pop("FXPAR_CACHE_DIR", None)
        out = subprocess.run([sys.executable, __file__, "--codegen-child", str(n), "--seq",
                              str(seq), *extra], env=env, capture_output=True, text=True,
                             check=True).stdout
        return next(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT"))
    print(f"{'layers':>6} {'first s':>8} {'runs':>5} {'second s':>9} {'hits':>5} {'ratio':>6} "
          f"{'spanning first s':>16} {'runs':>5}")
    for n in layers:
        with tempfile.TemporaryDirectory(prefix="fxpar-codegen-") as cache:
            (t1, r1, _), (t2, _, h2) = job(n, cache), job(n, cache)
        with tempfile.TemporaryDirectory(prefix="fxpar-codegen-") as cache:
            t3, r3, _ = job(n, cache, "--spanning")
        print(f"{n:>6} {float(t1):>8.1f} {r1:>5} {float(t2):>9.2f} {h2:>5} "
              f"{float(t2) / float(t1):>6.3f} {float(t3):>16.1f} {r3:>5}", flush=True)


def first_step_child(layers: int) -> None:
    """One job: parallelize, then 2 steps; prints the compile (parallelize plus the first
    step's time over the second's), the capture and codegen phases, and the second step."""
    import time

    import fxpar
    from first_steps import SIZE, model_and_batch
    model, batch_of = model_and_batch(layers, "cpu", **SIZE)
    t0 = time.perf_counter()
    pm = fxpar.parallelize(model, 1, example_batch=batch_of(0),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    t1 = time.perf_counter()
    pm.step(batch_of(0))
    t2 = time.perf_counter()
    pm.step(batch_of(1))
    t3 = time.perf_counter()
    phases = dict((name, s) for name, s, _ in pm.compile_times)
    codegen = sum(s for name, s in phases.items() if name.startswith("codegen"))
    print(f"RESULT {t1 - t0 + (t2 - t1) - (t3 - t2):.2f} {phases['capture']:.2f} "
          f"{codegen:.2f} {t3 - t2:.2f}")


def to_first_step(layers: list[int]) -> None:
    """Per depth: a first job in an empty cache, then a later job on that cache."""
    import subprocess
    import sys
    import tempfile

    def job(n, cache):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        env.pop("FXPAR_CACHE_DIR", None)
        out = subprocess.run([sys.executable, __file__, "--first-step-child", str(n)], env=env,
                             capture_output=True, text=True, check=True).stdout
        return [float(x) for x in next(line.split()[1:] for line in out.splitlines()
                                       if line.startswith("RESULT"))]
    print(f"{'layers':>6} {'job':>6} {'compile s':>10} {'capture s':>10} {'codegen s':>10} "
          f"{'step s':>7} {'compile / first depth':>21}")
    first = {}
    for n in layers:
        with tempfile.TemporaryDirectory(prefix="fxpar-first-step-") as cache:
            for kind in ("first", "later"):
                compile_s, capture_s, codegen_s, step_s = job(n, cache)
                first.setdefault(kind, compile_s)
                print(f"{n:>6} {kind:>6} {compile_s:>10.1f} {capture_s:>10.2f} {codegen_s:>10.1f} "
                      f"{step_s:>7.2f} {compile_s / first[kind]:>21.2f}", flush=True)


def capture_vs_torch(layers: list[int], seq: int, rounds: int = 3) -> None:
    """Median capture seconds of fxpar's joint export and of torch's, per depth."""
    import statistics
    import time

    from torch._functorch.aot_autograd import aot_export_module

    from fxpar.compiler import capture as cap
    ours = cap._export_joint

    def torchs(wrapper, args, table):
        return aot_export_module(wrapper, args, trace_joint=True, output_loss_index=0,
                                 decompositions=table)
    print(f"{'layers':>6} {'nodes':>6} {'fxpar s':>8} {'torch s':>8} {'fxpar/torch':>11}")
    for n in layers:
        torch.manual_seed(0)
        model = gpt2(n, seq)
        ids = torch.randint(0, 50257, (2, seq))
        batch = {"input_ids": ids, "labels": ids}
        times = {ours: [], torchs: []}
        for r in range(rounds + 1):  # the first round warms both up
            for export in (ours, torchs):
                cap._export_joint = export
                t0 = time.perf_counter()
                gm, _ = cap.capture(model, batch, stamp=False)  # (every block traced)
                if r:
                    times[export].append(time.perf_counter() - t0)
        cap._export_joint = ours
        a, b = statistics.median(times[ours]), statistics.median(times[torchs])
        print(f"{n:>6} {len(gm.graph.nodes):>6} {a:>8.2f} {b:>8.2f} {a / b:>11.3f}", flush=True)


def per_block_vs_spanning(layers: list[int], seq: int, width: int, rounds: int = 10) -> None:
    import statistics
    import tempfile
    import time

    import fxpar
    from fxpar.compiler import codegen
    from fxpar.core import ir
    print(f"{'layers':>6} {'step ms per block':>17} {'spanning':>9} {'per block/spanning':>18}")
    for n in layers:
        torch.manual_seed(0)
        model = gpt2(n, seq, width)
        ids = torch.randint(0, 50257, (2, seq))
        prog = fxpar.compile(model, 1, example_batch={"input_ids": ids, "labels": ids},
                             plan={"fuse": False, "codegen": "inductor"})
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        inputs = [named[p.meta["fqn"]] if p.meta[ir.ROLE] != "batch" else ids
                  for p in prog.graph.graph.nodes if p.op == "placeholder"]
        compiled = {per_block: codegen.generate(prog.graph, "cpu", "joint",
                                                per_block=per_block)
                    for per_block in (True, False)}
        times = {True: [], False: []}
        for r in range(rounds + 2):  # two warm-up rounds (the first call's check)
            for per_block, gm in compiled.items():
                t0 = time.perf_counter()
                gm(*inputs)
                if r > 1:
                    times[per_block].append(time.perf_counter() - t0)
        a, b = (1e3 * statistics.median(times[k]) for k in (True, False))
        print(f"{n:>6} {a:>17.1f} {b:>9.1f} {a / b:>18.3f}", flush=True)


def zoo_stamped(depth: int) -> None:
    """Every zoo model rebuilt with `depth` layers (its configs' layer counts of 2 raised):
    capture with its repeated blocks stamped and tracing every block, the graphs compared
    node for node (repeated_blocks._canonical); prints whether it was stamped, and why not."""
    import logging

    from fxpar.compiler import capture as cap
    from fxpar.compiler import repeated_blocks as rb
    from fxpar.examples import zoo
    keys = ("n_layer", "num_hidden_layers", "num_layers", "n_layers", "encoder_layers",
            "decoder_layers", "num_decoder_layers")

    def deeper(make):
        def build(config_cls, model_cls, **kw):
            return make(config_cls, model_cls,
                        **{k: depth if k in keys and v == 2 else v for k, v in kw.items()})
        return build
    zoo._hf, zoo._hf_eager = deeper(zoo._hf), deeper(zoo._hf_eager)
    zoo._DENSE["num_hidden_layers"] = depth
    why: list[str] = []

    class Why(logging.Handler):
        def emit(self, record):
            if "stamped" in record.getMessage():
                why.append(record.getMessage())
    for name in ("fxpar.compiler.capture", "fxpar.compiler.repeated_blocks"):
        logging.getLogger(name).addHandler(Why())
        logging.getLogger(name).setLevel(logging.DEBUG)
    counts = {"models": 0, "block list": 0, "stamped": 0, "equal": 0}
    for name in zoo.models():
        why.clear()
        try:
            model, spec = zoo.build(name)
        except Exception as e:  # noqa: BLE001 - a config that needs its per-layer lists
            print(f"{name:24} not built at {depth} layers: {type(e).__name__}")
            continue
        batch = spec.batch(0)
        stamped, sig = cap.capture(model, batch, spec.loss_fn)
        whole, whole_sig = cap.capture(model, batch, spec.loss_fn, stamp=False)
        equal = rb._canonical(stamped) == rb._canonical(whole) and sig == whole_sig
        found = rb.find(model)
        counts["models"] += 1
        counts["block list"] += found is not None
        counts["stamped"] += any("stamped the rest" in w for w in why)
        counts["equal"] += equal
        print(f"{name:24} {found[0] if found else '-':28} equal={equal} "
              f"{why[-1][:110] if why else ''}", flush=True)
    print(counts)


def ranks_rank(variant: str, layers: int, seq: int, width: int) -> float:
    """On each rank of a fresh launch: every rank compiling (fxpar.compile) or parallelize's
    compile once; seconds until this rank holds the Program."""
    import time

    import torch.distributed as dist

    import fxpar
    from fxpar.runtime import dist as rdist
    world = int(os.environ["WORLD_SIZE"])
    rdist.setup(world)  # (the job's default group, for the barrier)
    ids = torch.randint(0, 50257, (2 * world, seq))
    batch = {"input_ids": ids, "labels": ids}
    plan = {"dp": world, "codegen": "eager"}  # (the compile, not Inductor's code generation)
    fxpar.compile(gpt2(1, seq, 96), world, example_batch=batch, plan=plan)  # warm: imports
    torch.manual_seed(0)
    model = gpt2(layers, seq, width)
    dist.barrier()
    t = time.perf_counter()
    if variant == "every rank compiles":
        fxpar.compile(model, world, example_batch=batch, plan=plan)
        return time.perf_counter() - t
    pm = fxpar.parallelize(model, world, example_batch=batch, plan=plan)
    names = ("program to the ranks", "program from rank 0")
    upto = next(i for i, r in enumerate(pm.compile_times) if r[0] in names)
    first = next((i for i, r in enumerate(pm.compile_times) if r[0] == "capture"),
                 upto)  # (rank 0: from its capture; the others: their wait)
    return sum(r[1] for r in pm.compile_times[first:upto + 1])


def ranks_vs_every_rank(world: int, layers: int, seq: int, width: int, rounds: int = 3) -> None:
    import statistics

    import fxpar
    got: dict = {"every rank compiles": [], "rank 0 compiles, sends": []}
    for _ in range(rounds):  # (interleaved, each a fresh launch: a fresh heap to measure)
        for variant, runs in got.items():
            runs.append(fxpar.launch(ranks_rank, world, variant, layers, seq, width))
    print(f"GPT-2 {layers} layers x {width}, sequence {seq}, dp={world}, {world} ranks "
          f"(median of {rounds}): seconds until each rank holds the Program")
    print(f"{'variant':>23} {'slowest rank s':>15} " +
          " ".join(f"{'rank ' + str(r) + ' s':>9}" for r in range(world)))
    slowest = {}
    for variant, runs in got.items():
        slowest[variant] = statistics.median(max(run.values()) for run in runs)
        each = [statistics.median(run[r] for run in runs) for r in range(world)]
        print(f"{variant:>23} {slowest[variant]:>15.2f} " +
              " ".join(f"{t:>9.2f}" for t in each))
    print("rank 0 compiles, sends / every rank compiles: "
          f"{slowest['rank 0 compiles, sends'] / slowest['every rank compiles']:.3f}")


def main():
    import fxpar
    from fxpar.core import ir
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,12,48")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--codegen", action="store_true",
                    help="code generation's time, first job vs a later one (the cache)")
    ap.add_argument("--vs-torch", action="store_true",
                    help="capture: fxpar's one-trace joint export vs torch's aot_export_module")
    ap.add_argument("--per-block", action="store_true",
                    help="code generation per repeated block vs runs spanning layers")
    ap.add_argument("--zoo-stamped", type=int, metavar="LAYERS",
                    help="every zoo model at this depth: stamped capture == every block traced?")
    ap.add_argument("--to-first-step", action="store_true",
                    help="parallelize + the first step's check, first and later job")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--ranks", type=int, metavar="N",
                    help="parallelize's compile on rank 0, sent, vs every rank compiling")
    ap.add_argument("--first-step-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--codegen-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spanning", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.zoo_stamped:
        return zoo_stamped(args.zoo_stamped)
    if args.ranks:
        return ranks_vs_every_rank(args.ranks, int(args.layers.split(",")[0]), args.seq,
                                   args.width)
    if args.first_step_child:
        return first_step_child(args.first_step_child)
    if args.to_first_step:
        return to_first_step([int(x) for x in args.layers.split(",")])
    if args.codegen_child:
        return codegen_child(args.codegen_child, args.seq, not args.spanning)
    if args.vs_torch:
        return capture_vs_torch([int(x) for x in args.layers.split(",")], args.seq)
    if args.per_block:
        return per_block_vs_spanning([int(x) for x in args.layers.split(",")], args.seq,
                                     args.width)
    if args.codegen:
        return codegen_times([int(x) for x in args.layers.split(",")], args.seq)
    import time

    from fxpar.compiler import capture as cap
    print(f"{'layers':>6} {'nodes':>6} {'capture s':>10} {'passes s':>9} {'ms/node':>8} "
          f"{'whole trace s':>14} {'stamped/whole':>13}")
    for layers in (int(x) for x in args.layers.split(",")):
        torch.manual_seed(0)
        model = gpt2(layers, args.seq)
        ids = torch.randint(0, 50257, (2, args.seq))
        batch = {"input_ids": ids, "labels": ids}
        fxpar.compile(model, 1, example_batch=batch, plan={"fuse": False})  # warm: imports
        prog = fxpar.compile(model, 1, example_batch=batch, plan={"fuse": False})
        t0, t1 = 0.0, dict((name, t) for name, t, _ in prog.compile_times)["capture"]
        t2 = t1 + sum(t for _, t, _ in prog.graph.meta[ir.PASS_TIMES])  # verify + passes
        gm = prog.graph
        n = len(gm.graph.nodes)
        # the same capture tracing every block (compiler/repeated_blocks.py off)
        w0 = time.perf_counter()
        cap.capture(model, batch, stamp=False)
        whole = time.perf_counter() - w0
        print(f"{layers:>6} {n:>6} {t1 - t0:>10.2f} {t2 - t1:>9.2f} "
              f"{1e3 * (t2 - t0) / n:>8.2f} {whole:>14.2f} {(t1 - t0) / whole:>13.3f}",
              flush=True)


if __name__ == "__main__":
    main()
