"""The ``pgs`` command line (docs/cli.md).

Only ``argparse`` is imported up front, so that ``pgs --help`` answers at once; torch,
transformers and the runtime are imported inside the command that needs them.  Every
``PgsError`` becomes one line on stderr and its exit code (docs/exit-codes.md); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
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
    g = p.add_argument_group("several hosts", "torchrun's rendezvous options, handed through unchanged; one "
                                              "`pgs run --nproc N ...` per host (docs/distributed.md)")
    g.add_argument("--nnodes", default=None, metavar="M|MIN:MAX", help="hosts taking part")
    g.add_argument("--node-rank", type=int, default=None, metavar="R", help="this host's rank (static rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the rendezvous server")
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="the job's id (the same on every host)")
    g.add_argument("--rdzv-backend", default=None, metavar="NAME", help="c10d (default of torchrun) or etcd")
    g.add_argument("--master-addr", default=None, metavar="HOST", help="host of rank 0 (static rendezvous)")
    g.add_argument("--master-port", type=int, default=None, metavar="PORT", help="port on --master-addr")
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


def cmd_run(args) -> int:
    spec = _load(args)
    if args.resume not in (None, "auto") and not os.path.exists(args.resume):
        raise SpecError(f"--resume: no such checkpoint: {args.resume}")
    if args.overwrite and args.resume is not None:
        raise SpecError("--overwrite starts over, --resume continues: give one of them")
    rendezvous = _rendezvous(args)
    if (args.nproc > 1 or not rendezvous.standalone) and "LOCAL_RANK" not in os.environ:
        from pgs.runtime.dist.launch import launch_run

        return launch_run(spec, args.spec, nproc=args.nproc, overrides=args.overrides, resume=args.resume,
                          overwrite=args.overwrite, profile=args.profile, rendezvous=rendezvous)
    from pgs.runtime.loop.faults import Faults
    from pgs.runtime.loop.trace import parse_steps
    from pgs.runtime.loop.train import run

    return int(run(spec, resume=args.resume, spec_path=os.path.abspath(args.spec),
                   profile=parse_steps(args.profile) if args.profile else None, overwrite=args.overwrite,
                   faults=Faults.from_env()) or 0)


#: ``pgs run``'s options handed to torchrun as they are (their names are torchrun's).
RENDEZVOUS_OPTIONS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend", "master_addr", "master_port")


def _rendezvous(args):
    """torchrun's rendezvous options given to ``pgs run`` (``launch.Rendezvous``)."""
    from pgs.runtime.dist.launch import Rendezvous

    given = {k: getattr(args, k) for k in RENDEZVOUS_OPTIONS if getattr(args, k, None) is not None}
    return Rendezvous(**given)


def cmd_validate(args) -> int:
    from pgs.runtime.tools.validate import validate

    return validate(_load(args), records=args.records)


def cmd_report(args) -> int:
    from pgs.runtime.tools.report import write_report

    write_report(args.run_dir)
    return 0


def cmd_data_inspect(args) -> int:
    from pgs.runtime.tools.validate import inspect_spec

    return inspect_spec(_load(args), n=args.n, records=args.records)


def cmd_profile(args) -> int:
    from pgs.runtime.tools.profile import profile

    return int(profile(_load(args), measure=args.measure, spec_path=os.path.abspath(args.spec)) or 0)
