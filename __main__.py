"""Command line: `python -m fxpar demo|viz|plan ...` (also installed as `fxpar`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def _example(name: str):
    import torch
    from fxpar.examples import models as M
    cfg = M.GPTConfig()
    table = {
        "mlp": (M.MLP, lambda b: (torch.randn(b, 16), torch.randn(b, 4))),
        "gpt": (lambda: M.GPT(cfg), lambda b: M.gpt_batch(cfg, b)),
        "convbn": (M.ConvBN, lambda b: (torch.randn(b, 3, 8, 8), torch.randint(0, 5, (b,)))),
        "hf_gpt2": (M.hf_gpt2, lambda b: M.hf_lm_batch(128, b, 16)),
        "hf_llama": (M.hf_llama, lambda b: M.hf_lm_batch(128, b, 16)),
        "hf_bert": (M.hf_bert, lambda b: {"input_ids": torch.randint(0, 128, (b, 16)),
                                          "labels": torch.randint(0, 3, (b,))}),
    }
    if name not in table:
        sys.exit(f"unknown example {name!r}; choose one of {sorted(table)}")
    factory, batch = table[name]
    return factory(), batch


def cmd_viz(args):
    """Compile an example for a plan (fxpar.compile: no processes) and write one SVG per pass."""
    import fxpar
    from fxpar.viz.graph import summary, write_snapshots
    model, batch_fn = _example(args.example)
    remat = int(args.remat) if args.remat.isdigit() else args.remat
    prog = fxpar.compile(model, args.dp * args.pp * args.tp, example_batch=batch_fn(args.batch),
                         plan={"dp": args.dp, "pp": args.pp, "tp": args.tp, "remat": remat,
                               "zero": args.zero, "microbatches": args.microbatches,
                               "schedule": args.schedule})
    for p in write_snapshots(prog.stage_graphs, args.out):
        print(p)
    if "remat" in prog.stage_graphs:
        from fxpar.viz.memory_plot import plot_remat
        print(plot_remat(prog.stage_graphs, os.path.join(args.out, "memory_remat.png")))
    print(summary(prog.graph))


def cmd_demo(args):
    from fxpar.examples.demo import main
    remat = int(args.remat) if args.remat.isdigit() else args.remat
    main(args.out, args.nprocs, args.steps, args.batch, remat, args.pp, args.schedule)


def cmd_plan(args):
    """Rank the plans for a model on N devices (nothing is allocated: fake tensors)."""
    import json
    import torch
    from fxpar.compiler import cost, planner
    from fxpar.examples import gpt_stats as G
    from fxpar.compiler.errors import FxparError
    dev = args.device_type
    precision = args.precision or ("fp32" if dev == "cpu" else "bf16")
    if dev == "cpu":
        hw = cost.cpu_hardware()
    else:
        hw = cost.HARDWARE[dev]
    hw = dataclasses.replace(hw)
    if args.memory_per_device:
        hw.memory = int(float(args.memory_per_device) * 2 ** 30)
    if args.gpus_per_node:
        hw.devices_per_node = args.gpus_per_node
    try:
        if ":" in args.model:
            stats, rows = _factory_stats(args.model, precision)
        else:
            stats = G.gpt_stats(args.model, seq=args.seq, precision=precision)
            rows = args.batch
        constraints = json.loads(args.fix) if args.fix else {}
        result = planner.search(stats, args.devices, hw, batch_rows=args.batch or rows,
                                precision=precision, optimizer=args.optimizer,
                                constraints=constraints, executable=False)
    except FxparError as e:
        sys.exit(f"fxpar plan: {e}")
    print(result.format(args.top))
    if args.explain:
        print(result.explain())


def _factory_stats(spec, precision="fp32"):
    """pkg.module:factory -> factory() returning (model, example_batch[, loss_fn]), built on
    fake tensors."""
    import importlib
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxpar.compiler import planner
    mod, _, fn = spec.partition(":")
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = getattr(importlib.import_module(mod), fn)()
    model, batch, *rest = out if isinstance(out, tuple) else (out, None)
    if batch is None:
        sys.exit(f"{spec} must return (model, example_batch[, loss_fn])")
    stats = planner.graph_stats(model, batch, rest[0] if rest else None, precision=precision)
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return stats, int(leaves[0].shape[0])


def cmd_zoo(args):
    """Train zoo models under every plan against eager PyTorch; print (and write) the table."""
    from fxpar.examples import zoo, zoo_sweep
    os.environ.setdefault("FXPAR_DEVICE", "cpu")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    names = args.models.split(",") if args.models else list(zoo.models())
    unknown = sorted(set(names) - set(zoo.models()))
    if unknown:
        sys.exit(f"fxpar zoo: unknown model(s) {unknown}; choose from {sorted(zoo.models())}")
    plans = args.plans.split(";") if args.plans else list(zoo_sweep.PLANS)
    bad = sorted(set(plans) - set(zoo_sweep.PLANS))
    if bad:
        sys.exit(f"fxpar zoo: unknown plan column(s) {bad}; choose from {list(zoo_sweep.PLANS)}")
    cells = zoo_sweep.sweep(names, plans)
    table = zoo_sweep.markdown(cells, plans)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# The model zoo: every model under every plan, against eager PyTorch\n\n"
                    "Written by `python -m fxpar zoo --out docs/zoo.md` (examples/zoo.py, "
                    f"examples/zoo_sweep.py): {zoo_sweep.STEPS} AdamW steps on 2 CPU ranks "
                    "(gloo) from the same initial weights and batches as one eager process; "
                    "\"exact\" = losses and every parameter within rtol 1e-5 (params atol "
                    "1e-5; elements whose eager gradient is zero up to rounding, where Adam "
                    "turns rounding into lr-sized steps, within that bound). \"auto (2)\" "
                    "shows the plan the planner chose.\n\n" + table)
    if any(c.status in ("crash", "mismatch") for c in cells):
        sys.exit(1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="fxpar")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train the small GPT on CPU ranks, write the graph SVGs")
    d.add_argument("--out", default="out")
    d.add_argument("--nprocs", type=int, default=2)
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--remat", default="sqrt", help='"none" | "sqrt" | "auto" | budget bytes')
    d.add_argument("--pp", type=int, default=1, help="pipeline stages (4 microbatches)")
    d.add_argument("--schedule", default="1f1b",
                   help="gpipe | 1f1b | interleaved | zero-bubble")
    d.set_defaults(fn=cmd_demo)
    v = sub.add_parser("viz", help="write the graph SVG after every pass for an example")
    v.add_argument("--example", default="gpt")
    v.add_argument("--dp", type=int, default=2)
    v.add_argument("--batch", type=int, default=8)
    v.add_argument("--out", default=os.path.join("out", "viz"))
    v.add_argument("--remat", default="none", help='"none" | "sqrt" | "auto" | budget bytes')
    v.add_argument("--zero", type=int, default=0, help="ZeRO stage 0..3")
    v.add_argument("--pp", type=int, default=1, help="pipeline stages")
    v.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    v.add_argument("--microbatches", type=int, default=1)
    v.add_argument("--schedule", default="1f1b",
                   help="gpipe | 1f1b | interleaved | zero-bubble")
    v.set_defaults(fn=cmd_viz)
    p = sub.add_parser("plan", help="rank the parallel plans of a model on N devices "
                                    "(cost model; nothing is run)")
    p.add_argument("--model", default="gpt-175b",
                   help="small | gpt-1.7b ... gpt-175b | gpt-1t (Narayanan et al. 2021 "
                        "configs) | pkg.module:factory returning (model, example_batch)")
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--device-type", default="a100", choices=["a100", "h100", "h200", "cpu"])
    p.add_argument("--memory-per-device", default=None, help="GiB (default: the data sheet)")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (GPUs: bf16)")
    p.add_argument("--optimizer", default="adamw", help="sgd | sgd_momentum | adam | adamw")
    p.add_argument("--fix", default=None, help='Plan fields to keep fixed, JSON: \'{"tp": 8}\'')
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--explain", action="store_true", help="say why the best plan won")
    p.set_defaults(fn=cmd_plan)
    z = sub.add_parser("zoo", help="train the model zoo (39 architectures) under every plan "
                                   "against eager PyTorch and print the table")
    z.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    z.add_argument("--plans", default=None,
                   help='semicolon-separated columns, e.g. "1 device;dp=2" (default: all)')
    z.add_argument("--out", default=None, help="also write the table as markdown here")
    z.set_defaults(fn=cmd_zoo)
    args = ap.parse_args(argv)
    if args.cmd == "plan" and args.batch is None and ":" not in args.model:
        args.batch = 8 if args.model == "small" else 1536
    args.fn(args)


if __name__ == "__main__":
    main()
