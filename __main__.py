"""Command line: `python -m fxpar demo|viz ...` (also installed as `fxpar`)."""
from __future__ import annotations

import argparse
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
    """Compile an example for a plan (no processes needed) and write one SVG per pass."""
    import torch
    from fxpar.compiler.capture import capture
    from fxpar.compiler.passes import PassContext, run_passes
    from fxpar.compiler.plan import resolve
    from fxpar.viz.graph import summary, write_snapshots
    model, batch_fn = _example(args.example)
    batch = batch_fn(args.batch)
    if args.microbatches > 1:  # the graph of one microbatch, as parallelize traces it
        batch = torch.utils._pytree.tree_map(
            lambda t: t.chunk(args.microbatches)[0] if isinstance(t, torch.Tensor) else t, batch)
    gm, sig = capture(model, batch)
    snaps = {}
    ctx = PassContext(signature=sig, group_names={"dp": "dp", "tp": "tp"},
                      virtual_stages=2 if args.schedule == "interleaved" else 1)
    remat = int(args.remat) if args.remat.isdigit() else args.remat
    plan = resolve({"dp": args.dp, "pp": args.pp, "tp": args.tp, "remat": remat,
                    "zero": args.zero, "microbatches": args.microbatches,
                    "schedule": args.schedule}, args.dp * args.pp * args.tp)
    gm = run_passes(gm, plan, ctx, "dp", snaps)
    for p in write_snapshots(snaps, args.out):
        print(p)
    if "remat" in snaps:
        from fxpar.viz.memory import plot_remat
        print(plot_remat(snaps, os.path.join(args.out, "memory_remat.png")))
    print(summary(gm))


def cmd_demo(args):
    from fxpar.examples.demo import main
    remat = int(args.remat) if args.remat.isdigit() else args.remat
    main(args.out, args.nprocs, args.steps, args.batch, remat, args.pp, args.schedule)


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
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
