"""The ``pgs`` command line (docs/cli.md).

Only ``argparse`` is imported up front, so that ``pgs --help`` answers at once; torch,
transformers and the runtime are imported inside the command that needs them.  Every
``PgsError`` becomes one line on stderr and its exit code (docs/exit-codes.md); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pgs.errors import EXIT_BAD_INPUT, PgsError, SpecError

EXIT_INTERRUPTED = 130  # 128 + SIGINT

DESCRIPTION = "pgs (palingenesis): full fine-tuning of language models from one TOML spec."

EXAMPLES = """\
examples:
  pgs validate spec.toml                       check everything before spending GPU time
  pgs run spec.toml --set train.steps=20       a short run with one field changed
  pgs run spec.toml --resume auto              continue from the newest complete checkpoint
  pgs run spec.toml --nproc 4                  one process per GPU (torchrun)
  pgs data inspect spec.toml -n 3              see which tokens are trained
  pgs report runs/quickstart                   plots and a summary of a run

docs: docs/spec.md (every field), docs/cli.md, docs/exit-codes.md"""


class NotAvailable(PgsError):
    """A command whose component is not part of this installation (exit 1)."""

    exit_code = 1


# --------------------------------------------------------------------------- parser


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a spec field with a TOML value, e.g. --set train.steps=20 "
             "--set optimizer.alias='\"lion\"' (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgs", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pgs {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    p = sub.add_parser("run", help="train as the spec says", description="Train as the spec says.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--resume", metavar="auto|PATH",
                   help="'auto': the newest complete checkpoint of the run folder, if any; or a checkpoint folder")
    p.add_argument("--overwrite", action="store_true",
                   help="start fresh in a run folder that already holds a run: move that run aside to "
                        "<dir>.old-<timestamp> first")
    p.add_argument("--profile", metavar="A:B", default=None,
                   help="write a torch profiler trace of steps A to B to <run dir>/profile/ (docs/cli.md)")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="processes (GPUs) on this host; N > 1 relaunches through torchrun")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("validate", help="check a spec, its model, tokenizer and data; run nothing",
                       description="Resolve and check everything a run needs, then print a summary. "
                                   "Exit 0 when the spec is runnable, 2 when it is not.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--records", type=int, default=200, metavar="N",
                   help="records read from each data file (default 200; 0 reads every record)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("report", help="plots and a summary table of a run's metrics.jsonl",
                       description="Write RUN_DIR/report/*.png and report/summary.md from RUN_DIR/metrics.jsonl.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (checkpoint.dir)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("data", help="look at the training data (pgs data inspect SPEC)",
                       description="Look at the training data as the run will see it.")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", title="subcommands")
    p.set_defaults(func=lambda args: _missing_subcommand(p))
    q = data_sub.add_parser("inspect", help="samples with their trained tokens highlighted, and statistics",
                            description="Print the first samples with trained tokens highlighted, then "
                                        "statistics of the data (lengths, drops, packing).")
    q.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(q)
    q.add_argument("-n", type=int, default=5, metavar="N", help="samples to show (default 5)")
    q.add_argument("--records", type=int, default=0, metavar="N",
                   help="records read from each source for the statistics (default 0: all)")
    q.set_defaults(func=cmd_data_inspect)

    p = sub.add_parser("profile", help="estimate (or --measure) memory and speed of a spec",
                       description="Estimate the memory and throughput of a spec; --measure runs a few steps.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--measure", action="store_true", help="run a few real steps instead of estimating")
    p.set_defaults(func=cmd_profile)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pgs")
    except Exception:  # not installed as a distribution (a plain checkout)
        return "unknown"


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pgs`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except PgsError as err:
        print(f"pgs: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("pgs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# --------------------------------------------------------------------------- commands


def _load(args):
    from pgs.runtime.spec.load import load_spec

    return load_spec(args.spec, args.overrides)


def _component(module: str, command: str):
    """Import ``module`` for ``command``; a clear ``NotAvailable`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise  # the module exists and one of its own imports failed: a real bug
        raise NotAvailable(f"{command} needs {module}, which is not part of this installation yet") from None


def cmd_run(args) -> int:
    spec = _load(args)
    if args.resume not in (None, "auto") and not os.path.exists(args.resume):
        raise SpecError(f"--resume: no such checkpoint: {args.resume}")
    if args.overwrite and args.resume is not None:
        raise SpecError("--overwrite starts over, --resume continues: give one of them")
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_torchrun(args, spec)
    profile = None
    if args.profile:
        from pgs.runtime.loop.trace import parse_steps

        profile = parse_steps(args.profile)
    train = _component("pgs.runtime.loop.train", "pgs run")
    extra = {"overwrite": True} if args.overwrite else {}
    return int(train.run(spec, resume=args.resume, spec_path=os.path.abspath(args.spec), profile=profile,
                         **extra) or 0)


def cmd_validate(args) -> int:
    from pgs.runtime.spec.preflight import check_resources  # the same checks pgs run makes, then the data

    spec = _load(args)
    found = check_resources(spec, records=args.records)
    print_summary(spec, found)
    return 0


def cmd_report(args) -> int:
    from pgs.runtime.tools.report import write_report

    write_report(args.run_dir)
    return 0


def cmd_data_inspect(args) -> int:
    spec = _load(args)
    inspect = _component("pgs.runtime.data.inspect", "pgs data inspect")
    from pgs.runtime.spec.preflight import load_tokenizer

    tokenizer = load_tokenizer(spec.model.tokenizer, spec.model.trust_remote_code)
    inspect.inspect_dataset(spec.data, tokenizer, n=args.n, max_records=args.records or None)
    return 0


def cmd_profile(args) -> int:
    spec = _load(args)
    profile = None
    for module in ("pgs.runtime.tools.profile", "pgs.runtime.loop.train"):
        try:
            profile = getattr(_component(module, "pgs profile"), "profile", None)
        except NotAvailable:
            continue
        if profile is not None:
            break
    if profile is None:
        raise NotAvailable("pgs profile needs pgs.runtime.tools.profile, which is not part of this installation yet")
    return int(profile(spec, measure=args.measure, spec_path=os.path.abspath(args.spec)) or 0)


# --------------------------------------------------------------------------- pgs run --nproc


def _launch_torchrun(args, spec) -> int:
    """Relaunch ``pgs run`` under torchrun with ``--nproc`` processes; return the run's verdict.

    ``launch.relaunch``: signals to this process are passed on to the workers (which
    checkpoint and stop together); torchrun collapses every worker's exit code to 1, so a
    ``HALT.json`` written during this launch decides the code, else 128+signum after a
    forwarded signal, else torchrun's.
    """
    from pgs.runtime.dist.launch import relaunch
    from pgs.runtime.spec.load import check_world_size

    from pgs.runtime.spec.preflight import preflight_spec

    preflight_spec(spec)  # the checks each worker makes, once here: a worker's refusal would read as exit 1
    check_world_size(spec.train, args.nproc)  # refuse before starting N processes
    if args.resume is None:  # refuse (or move the old run aside) once, before N processes start
        from pgs.runtime.store import checkpoint

        if args.overwrite:
            aside = checkpoint.move_aside(spec.checkpoint.dir)
            if aside is not None:
                print(f"pgs: --overwrite: moved the previous run to {aside}", file=sys.stderr, flush=True)
        else:
            checkpoint.refuse_existing_run(spec.checkpoint.dir)
    forwarded = ["run", os.path.abspath(args.spec)]
    for assignment in args.overrides:
        forwarded += ["--set", assignment]
    if args.resume:
        forwarded += ["--resume", args.resume]
    if args.profile:
        forwarded += ["--profile", args.profile]
    return relaunch(args.nproc, forwarded, run_dir=spec.run_dir)


# --------------------------------------------------------------------------- pgs validate


def print_summary(spec, facts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"pgs validate: {spec.source}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    m, t, s = spec.model, spec.train, spec.schedule
    table.add_row("model", (m.path or "random init") + f"  [{facts.get('model', '')}]")
    table.add_row("parameters", facts.get("parameters", "?") + (f", frozen {facts['frozen']}" if "frozen" in facts else ""))
    table.add_row("dtype / attention", f"{m.dtype} / {m.attn_implementation}"
                  + (f" ({m.varlen_kernel} kernel)" if m.varlen_kernel != "auto" else ""))
    table.add_row("tokenizer", f"{m.tokenizer}  [{facts.get('tokenizer', '')}]")
    stats = facts.get("data")
    for src in spec.data.sources:
        table.add_row("data source", f"{src.path}  (weight {src.weight:g}, format {src.format})")
    if stats is not None:
        table.add_row("data checked", f"{stats.records} records, {stats.samples} samples, "
                                      f"{stats.trained_tokens}/{stats.tokens} tokens trained, "
                                      f"packing {stats.packing_efficiency:.0%}")
    table.add_row("eval", f"{spec.data.eval}  [{facts['eval']}]" if spec.data.eval else "none")
    table.add_row("optimizer", facts.get("chain", ""))
    peak_lr = s.peak if s.name != "constant" else s.peak
    table.add_row("schedule", f"{s.name}, peak {peak_lr:g}, warmup {s.warmup}, total {s.total or 'train length'}")
    table.add_row("loss", f"{spec.loss.objective} ({spec.loss.backend})")
    length = f"{t.steps} steps" if t.steps is not None else f"{t.epochs} epochs"
    table.add_row("train", f"{length}, batch {t.batch_size} × {spec.data.max_seq_len} tokens, "
                           f"grad_accum {t.grad_accum}, device {t.device}")
    table.add_row("run folder", spec.run_dir)
    console.print(table)
    for warning in facts["warnings"] + (stats.warnings() if stats is not None else []):
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    console.print("[green]ok[/]: the spec is runnable")
