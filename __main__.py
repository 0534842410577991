"""Command line: `python -m fxpar demo|viz|plan|zoo ...` (also installed as `fxpar`);
`fxpar --version`; `fxpar SUBCOMMAND --help` lists every option with its default."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero-bubble"]
EXAMPLES = ["mlp", "gpt", "convbn", "hf_gpt2", "hf_llama", "hf_bert"]


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
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.core.errors import FxparError
    from fxpar.examples import gpt_stats as G
    dev = args.device_type
    precision = args.precision or ("fp32" if dev == "cpu" else "bf16")
    try:
        fix = json.loads(args.fix) if args.fix else {}
    except json.JSONDecodeError as e:
        args.parser.error(f"--fix {args.fix!r} is not JSON ({e}); write the Plan fields to "
                          """keep as an object, e.g. --fix '{"tp": 8}'""")
    if not isinstance(fix, dict):
        args.parser.error(f"--fix {args.fix!r} must be a JSON object of Plan fields, e.g. "
                          """'{"tp": 8, "zero": 1}'""")
    hw = dataclasses.replace(cost.cpu_hardware() if dev == "cpu" else cost.HARDWARE[dev])
    if args.memory_per_device:
        hw.memory = int(float(args.memory_per_device) * 2 ** 30)
    if args.gpus_per_node:
        hw.devices_per_node = args.gpus_per_node
    try:
        constraints = planner.constraints_of(fix)  # unknown fields: a clear error
        if args.depth is None and args.keep_first:
            args.parser.error("--keep-first goes with --depth")
        if args.depth is not None and args.depth <= args.keep_first:
            args.parser.error(f"--depth {args.depth} must exceed --keep-first "
                              f"{args.keep_first} (the blocks kept as traced)")
        if ":" in args.model:
            stats, rows = _factory_stats(args.model, precision, dev)
            if args.depth is not None:  # (a model traced a few blocks deep, at its depth)
                try:
                    stats = stats.with_depth(args.depth, keep_first=args.keep_first)
                except ValueError as e:
                    sys.exit(f"fxpar plan: --depth {args.depth}: {e}. Build the model with "
                             f"more blocks than the {args.keep_first} --keep-first keeps, "
                             "those after them alike.")
        elif args.depth is not None:
            args.parser.error("--depth and --keep-first scale a --model pkg.module:factory "
                              "(the built-in GPTs are priced at their own depth)")
        else:
            stats = G.gpt_stats(args.model, seq=args.seq, precision=precision)
            rows = 8 if args.model == "small" else 512 if args.model.startswith("gpt2") \
                else 1536
        result = planner.search(stats, args.devices, hw, batch_rows=args.batch or rows,
                                precision=precision, optimizer=args.optimizer,
                                constraints=constraints, executable=False)
        result.best.plan.validate(args.devices)  # (a field --fix gave a value it cannot take)
    except FxparError as e:
        sys.exit(f"fxpar plan: {e}")
    print(result.format(args.top))
    if args.explain:
        print(result.explain())


def _factory_stats(spec, precision="fp32", device="cpu"):
    """pkg.module:factory -> factory() returning (model, example_batch[, loss_fn]), built on
    fake tensors. Each way this fails ends the command with one line naming it."""
    import importlib
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxpar.compiler.compile import planner_stats
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        sys.exit(f"fxpar plan: --model {spec!r}: write it as pkg.module:factory")
    if os.getcwd() not in sys.path:  # (the `fxpar` script does not put it there; -m does)
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        sys.exit(f"fxpar plan: cannot import module {mod!r} (--model {spec}): "
                 f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - the module's own code failed on import
        sys.exit(f"fxpar plan: importing module {mod!r} (--model {spec}) raised "
                 f"{type(e).__name__}: {e}")
    factory = getattr(module, fn, None)
    if not callable(factory):
        sys.exit(f"fxpar plan: module {mod!r} ({getattr(module, '__file__', None)}) has no "
                 f"callable {fn!r} (--model {spec})")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: say which and why
        sys.exit(f"fxpar plan: {mod}.{fn}() raised {type(e).__name__}: {e}")
    model, batch, *rest = out if isinstance(out, tuple) else (out, None)
    if batch is None or not isinstance(model, torch.nn.Module):
        sys.exit(f"fxpar plan: {mod}.{fn}() must return (model, example_batch[, loss_fn]), "
                 f"got {type(out).__name__}")
    stats = planner_stats(model, batch, rest[0] if rest else None,
                          "cpu" if device == "cpu" else "cuda", precision=precision)
    return stats, stats.rows


def cmd_zoo(args):
    """Train zoo models under every plan against eager PyTorch; print (and write) the table."""
    from fxpar.examples import zoo, zoo_sweep
    os.environ.setdefault("FXPAR_DEVICE", "cpu")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    known = list(zoo.models())
    if args.external or args.models:
        from fxpar.examples import external_zoo, hf_causal_lms
        known += list(external_zoo.models())
        known += list(hf_causal_lms.models()) if args.models else []
    default = list(external_zoo.models()) if args.external else list(zoo.models())
    names = args.models.split(",") if args.models else default
    unknown = sorted(set(names) - set(known))
    if unknown:
        sys.exit(f"fxpar zoo: unknown model(s) {unknown}; choose from {sorted(known)}")
    plans = args.plans.split(";") if args.plans else [  # (no external model sets dropout)
        k for k in zoo_sweep.PLANS if not (args.external and k in zoo_sweep.DROPOUT)]
    bad = sorted(set(plans) - set(zoo_sweep.PLANS))
    if bad:
        sys.exit(f"fxpar zoo: unknown plan column(s) {bad}; choose from {list(zoo_sweep.PLANS)}")
    cells = zoo_sweep.sweep(names, plans)
    table = zoo_sweep.markdown(cells, plans)
    print(table)
    if args.out:
        title, cmd, src = (
            ("The external zoo", "zoo --external --out docs/external_zoo.md",
             "examples/external_zoo.py") if args.external else
            ("The model zoo", "zoo --out docs/zoo.md", "examples/zoo.py"))
        with open(args.out, "w") as f:
            f.write(f"# {title}: every model under every plan, against eager PyTorch\n\n"
                    f"Written by `python -m fxpar {cmd}` ({src}, "
                    f"examples/zoo_sweep.py): {zoo_sweep.STEPS} AdamW steps on 2 CPU ranks "
                    "(gloo) from the same initial weights and batches as one eager process; "
                    "\"exact\" = losses and every parameter within rtol 1e-5 (params atol "
                    "1e-5; elements whose eager gradient is zero up to rounding, where Adam "
                    "turns rounding into lr-sized steps, within that bound). \"rounding\" = "
                    "differs, but no more than eager trained from weights one ulp apart (or "
                    "with each batch's halves run apart, for a plan that splits it) does "
                    "(4x over), or Plan.verify passes its first step. \"auto (2)\" "
                    "shows the plan the planner chose.\n\n" + table)
    if any(c.status in ("crash", "mismatch") for c in cells):
        sys.exit(1)


def version() -> str:
    """fxpar's version (the pyproject.toml beside this package in a checkout, else the
    installed distribution's) and torch's."""
    import torch
    try:
        import tomllib  # Python 3.11+; on 3.10 the installed metadata answers
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "pyproject.toml"), "rb") as f:
            v = tomllib.load(f)["project"]["version"]
    except (ImportError, OSError, KeyError):
        v = importlib.metadata.version("fxpar")
    return f"fxpar {v} (torch {torch.__version__})"


class _Version(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, *_):
        print(version())
        parser.exit()


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless its help says it already (a None default)."""

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    fmt = _Help
    ap = argparse.ArgumentParser(prog="fxpar", formatter_class=fmt, description=(
        "fxpar: compile a PyTorch training step into parallel per-rank programs. Logging: "
        "FXPAR_LOGS=planner,+passes (see fxpar/core/logs.py)."))
    ap.add_argument("--version", action=_Version, help="print fxpar's and torch's versions")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{demo,viz,plan,zoo}")
    d = sub.add_parser("demo", formatter_class=fmt,
                       help="train the small GPT on CPU ranks, write the graph SVGs")
    d.add_argument("--out", default="out", help="directory for the SVGs, trace and report")
    d.add_argument("--nprocs", type=int, default=2, help="CPU ranks to spawn")
    d.add_argument("--steps", type=int, default=20, help="training steps")
    d.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    d.add_argument("--remat", default="sqrt", help='"none" | "sqrt" | "auto" | budget bytes')
    d.add_argument("--pp", type=int, default=1, help="pipeline stages (4 microbatches)")
    d.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (with --pp > 1)")
    d.set_defaults(fn=cmd_demo)
    v = sub.add_parser("viz", formatter_class=fmt,
                       help="write the graph SVG after every pass for an example")
    v.add_argument("--example", default="gpt", choices=EXAMPLES, help="the example model")
    v.add_argument("--dp", type=int, default=2, help="data-parallel degree")
    v.add_argument("--batch", type=int, default=8, help="example batch (rows)")
    v.add_argument("--out", default=os.path.join("out", "viz"), help="directory for the SVGs")
    v.add_argument("--remat", default="none", help='"none" | "sqrt" | "auto" | budget bytes')
    v.add_argument("--zero", type=int, default=0, choices=range(4), help="ZeRO stage")
    v.add_argument("--pp", type=int, default=1, help="pipeline stages")
    v.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    v.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches")
    v.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (with --pp > 1)")
    v.set_defaults(fn=cmd_viz)
    p = sub.add_parser("plan", formatter_class=fmt,
                       help="rank the parallel plans of a model on N devices (cost model; "
                            "nothing is run)")
    p.add_argument("--model", default="gpt2",
                   help="small | gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl | gpt-1.7b ... "
                        "gpt-175b, gpt-1t (Narayanan et al. 2021) | pkg.module:factory "
                        "returning (model, example_batch[, loss_fn])")
    p.add_argument("--devices", type=int, default=8, help="number of devices to plan for")
    p.add_argument("--device-type", default="a100", choices=["a100", "h100", "h200", "cpu"],
                   help="device data sheet to price with (cpu: this machine, measured)")
    p.add_argument("--memory-per-device", default=None,
                   help="GiB per device (default: the data sheet's)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node: groups within a node use the fast link "
                        "(default: the data sheet's)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch in rows (default: small 8, gpt2* 512, gpt-* 1536, a "
                        "factory's example batch)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length of the built-in GPTs (default: gpt2* 1024, gpt-* "
                        "2048)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="training precision (default: bf16 on GPUs, fp32 on cpu)")
    p.add_argument("--optimizer", default="adamw",
                   choices=["sgd", "sgd_momentum", "adam", "adamw"],
                   help="optimizer whose state is priced")
    p.add_argument("--depth", type=int, default=None,
                   help="with a factory: the model's real number of repeated blocks, where "
                        "the factory builds it a few blocks deep (tracing the full depth of a "
                        "large model takes minutes): one traced block stands for each")
    p.add_argument("--keep-first", type=int, default=0,
                   help="with --depth: the model's first blocks that differ from the rest "
                        "(e.g. DeepSeek-V3's 3 dense layers), traced and kept as they are")
    p.add_argument("--fix", default=None,
                   help='Plan fields to keep fixed, as JSON, e.g. \'{"tp": 8, "zero": 1}\'')
    p.add_argument("--top", type=int, default=10, help="how many ranked plans to print")
    p.add_argument("--explain", action="store_true", help="say why the best plan won")
    p.set_defaults(fn=cmd_plan, parser=p)
    z = sub.add_parser("zoo", formatter_class=fmt,
                       help="train the model zoo (examples/zoo.py) under every plan against "
                            "eager PyTorch and print the table")
    z.add_argument("--models", default=None,
                   help="comma-separated names of the zoo, the external zoo or "
                        "examples/hf_causal_lms.py (default: all of the zoo)")
    z.add_argument("--external", action="store_true",
                   help="the external zoo (torchtitan, timm, litgpt, nanoGPT model code; "
                        "examples/external_zoo.py) instead of the zoo")
    z.add_argument("--plans", default=None,
                   help='semicolon-separated columns, e.g. "1 device;dp=2" (default: all)')
    z.add_argument("--out", default=None, help="also write the table as markdown here")
    z.set_defaults(fn=cmd_zoo)
    return ap


def main(argv=None):
    from fxpar.core import logs
    args = parser().parse_args(argv)
    try:
        logs.configure()
    except ValueError as e:  # a misspelt FXPAR_LOGS
        sys.exit(f"fxpar: {e}")
    args.fn(args)


if __name__ == "__main__":
    main()
