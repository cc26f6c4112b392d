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
  pgs supervise spec.toml --retries 3          relaunch after crashes that made progress
  pgs data inspect spec.toml -n 3              see which tokens are trained
  pgs report runs/quickstart                   plots and a summary of a run
  pgs prepare spec.toml --out prep --select jshape --fraction 0.5
                                               score the data with the model, select a subset

docs: docs/spec.md (every field), docs/cli.md, docs/exit-codes.md"""


# --------------------------------------------------------------------------- parser


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a spec field with a TOML value, e.g. --set train.steps=20 "
             "--set optimizer.alias='\"lion\"' (repeatable)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line like every other refusal (``pgs: error: ...``,
    exit 2) instead of a usage block and a line of its own shape."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"pgs: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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

    p = sub.add_parser("supervise", help="run, and relaunch with --resume auto after a crash that made progress",
                       description="Run 'pgs run SPEC' in a process group of its own and relaunch it with "
                                   "--resume auto only when the exit was not a verdict (0, 2, 80-84, HALT.json), "
                                   "the attempt made progress and retries are left; every decision goes to "
                                   "<run dir>/supervise.jsonl (docs/cli.md).")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--resume", metavar="auto|PATH", help="as pgs run, for the first attempt (relaunches use auto)")
    p.add_argument("--overwrite", action="store_true", help="as pgs run, for the first attempt")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N", help="as pgs run")
    p.add_argument("--retries", type=_non_negative_int, default=2, metavar="N",
                   help="relaunches allowed (default 2)")
    p.add_argument("--backoff", type=float, default=30.0, metavar="SECONDS",
                   help="wait before the first relaunch, doubled for each further one (default 30, at most 600)")
    p.set_defaults(func=cmd_supervise)

    p = sub.add_parser("validate", help="check a spec, its model, tokenizer and data; run nothing",
                       description="Resolve and check everything a run needs, then print a summary. "
                                   "Exit 0 when the spec is runnable, 2 when it is not.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--records", type=_non_negative_int, default=200, metavar="N",
                   help="records read from each data file (default 200; 0 reads every record)")
    p.add_argument("--nproc", type=_positive_int, default=None, metavar="N",
                   help="check for pgs run --nproc N: its refusals, and one process's share of the memory")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("report", help="plots and a summary table of a run's metrics.jsonl",
                       description="Write RUN_DIR/report/*.png and report/summary.md from RUN_DIR/metrics.jsonl.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (checkpoint.dir)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("data", help="look at the training data (pgs data inspect SPEC)",
                       description="Look at the training data as the run will see it.")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", title="subcommands")
    p.set_defaults(func=lambda args, data=p: _missing_subcommand(data))  # this parser, not the last one named p
    q = data_sub.add_parser("inspect", help="samples with their trained tokens highlighted, and statistics",
                            description="Print the first samples with trained tokens highlighted, then "
                                        "statistics of the data (lengths, drops, packing).")
    q.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(q)
    q.add_argument("-n", type=_non_negative_int, default=5, metavar="N", help="samples to show (default 5)")
    q.add_argument("--records", type=_non_negative_int, default=0, metavar="N",
                   help="records read from each source for the statistics (default 0: all)")
    q.set_defaults(func=cmd_data_inspect)

    _add_prepare(sub)

    p = sub.add_parser("profile", help="estimate (or --measure) memory and speed of a spec",
                       description="Estimate the memory of the step the spec trains (SFT, [preference] or [distill]); "
                                   "--measure runs a few steps of it.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--measure", action="store_true", help="run a few real steps instead of estimating")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="estimate one of N processes of pgs run --nproc N (its share of the batch, its shards' "
                        "optimizer state)")
    p.set_defaults(func=cmd_profile)
    return parser


def _add_prepare(sub) -> None:
    """``pgs prepare``'s arguments."""
    p = sub.add_parser("prepare", help="score, select, order or self-answer the training data with the spec's model",
                       description="Score every sample with the spec's model on the tokens training uses (mean NLL, "
                                   "entropy, HES, length) into DIR/scores.jsonl and DIR/report/; select a subset "
                                   "(--select), write a TFP order (--order tfp) or the model's verified answers "
                                   "(--self-answer).  docs/prepare.md.")
    p.add_argument("spec", metavar="SPEC", help="the spec file (.toml)")
    _add_set(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (scoring resumes into it)")
    p.add_argument("--batch-size", type=_positive_int, default=16, metavar="N",
                   help="samples per forward (scoring) or prompts per generate call (default 16)")
    p.add_argument("--select", choices=("random", "jshape", "hes", "outliers"), default=None,
                   help="write DIR/selected.jsonl and DIR/random.jsonl (the random baseline of the same size)")
    p.add_argument("--size", type=_positive_int, default=None, metavar="N", help="samples to select")
    p.add_argument("--fraction", type=float, default=None, metavar="F",
                   help="share of the scored samples to select (hes: 0.2 by default)")
    p.add_argument("--outlier-z", type=float, default=None, metavar="Z",
                   help="drop samples whose length or NLL z-score exceeds Z before selecting (outliers: 3)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="selection / sampling seed (default data.seed)")
    p.add_argument("--order", choices=("tfp",), default=None,
                   help="write DIR/ordered.jsonl in Threshold Filtering Packing order (a standalone utility)")
    p.add_argument("--tfp-threshold", type=float, default=0.0, metavar="T",
                   help="TFP: minimum embedding distance to the last --tfp-window samples (default 0)")
    p.add_argument("--tfp-window", type=_positive_int, default=1, metavar="W",
                   help="TFP: samples the threshold looks back at")
    p.add_argument("--self-answer", action="store_true",
                   help="write DIR/self_answers.jsonl: the model's own answers that --verify accepts")
    p.add_argument("--verify", metavar="NAME", default=None,
                   help="exact, number, regex:PATTERN, json, tool_call, or module:function (runs your code)")
    p.add_argument("-k", type=_positive_int, default=4, metavar="K", help="answers sampled per prompt (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N", help="per answer (default 256)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="self-answer the first N records only")
    p.add_argument("--replay", metavar="FILE", default=None,
                   help="general prompts (JSONL) whose own answers are mixed into the self-answers")
    p.add_argument("--replay-share", type=float, default=0.25, metavar="S",
                   help="share of the written records that are replayed answers (default 0.25)")
    p.set_defaults(func=cmd_prepare)


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pgs")
    except Exception:  # not installed as a distribution (a plain checkout)
        return "unknown"


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_BAD_INPUT


def entry() -> int:
    """The ``pgs`` console script and ``python -m pgs``: :func:`main` as a process of its own,
    which keeps Triton out where no Triton kernel can run (``pgs.runtime.triton_gate``)."""
    return main(entry_point=True)


def leave(code: int) -> None:
    """End ``python -m pgs`` with ``code``.  A worker of ``pgs run --nproc`` first records the
    code where its launcher reads it (``$PGS_EXIT_DIR``)."""
    if os.environ.get("PGS_EXIT_DIR"):
        from pgs.runtime.dist.launch import record_exit

        record_exit(code)
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # Under torchrun, leave without running C++ static destructors: a gloo/NCCL worker thread
        # still winding down can abort the process ("terminate called without an active
        # exception") after the run has finished and written everything, turning exit 0/143 into
        # SIGABRT.  Everything the run writes is flushed and fsynced before this point.
        sys.stdout.flush()
        sys.stderr.flush()
        _remove_multiprocessing_tempdir()
        os._exit(code)
    raise SystemExit(code)


def _remove_multiprocessing_tempdir() -> None:
    """Remove the folder multiprocessing made for this process (``pymp-*`` in the temp folder:
    the data worker's fork-server socket).  Its own exit finalizer removes it, but ``os._exit``
    runs no finalizer, so every worker of every ``pgs run --nproc N`` would leave one behind.
    multiprocessing keeps the path in its process config (``util.get_temp_dir``, which would
    make one where none exists)."""
    import multiprocessing
    import shutil

    tempdir = getattr(multiprocessing.current_process(), "_config", {}).get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


def _openmp_waits_passively() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` for this process and its children, unless the environment
    says otherwise; set before torch is imported, since OpenMP reads it once, when it loads.

    By default an OpenMP thread that reaches the end of a parallel region spins until its
    siblings arrive.  Where another process takes a core, a sibling is descheduled and the
    others spin for its whole time slice, on every operator: the CPU time of a training step
    multiplies, and the slowdown is many times the CPU lost (docs/performance.md, *A busy
    machine*).  A passive wait sleeps instead, so a step costs the same CPU time however busy
    the machine is, and its wall time grows only with the CPU others take."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Run one ``pgs`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    if entry_point:
        _openmp_waits_passively()
        from pgs.runtime.triton_gate import keep_triton_out

        keep_triton_out()
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
    child = "LOCAL_RANK" in os.environ  # a process torchrun started: its launcher says the summary
    if (args.nproc > 1 or not rendezvous.standalone) and not child:
        from pgs.runtime.dist.launch import launch_run

        code = launch_run(spec, args.spec, nproc=args.nproc, overrides=args.overrides, resume=args.resume,
                          overwrite=args.overwrite, profile=args.profile, rendezvous=rendezvous)
    else:
        from pgs.runtime.loop.faults import Faults
        from pgs.runtime.loop.trace import parse_steps
        from pgs.runtime.loop.train import run
        from pgs.runtime.process import fit_cpu_threads

        fit_cpu_threads()

        code = int(run(spec, resume=args.resume, spec_path=os.path.abspath(args.spec),
                       profile=parse_steps(args.profile) if args.profile else None, overwrite=args.overwrite,
                       faults=Faults.from_env()) or 0)
    if not child:
        _print_summary(spec, code, args)
    return code


def _print_summary(spec, code: int, args) -> None:
    """The run's closing lines on stdout (``tools.summary``), after its progress on stderr."""
    from pgs.runtime.tools.summary import run_summary

    again = [args.spec, *(a for s in args.overrides for a in ("--set", s))]
    if args.nproc > 1:
        again += ["--nproc", str(args.nproc)]
    lines = run_summary(spec, code, again)
    if lines:
        sys.stderr.flush()
        print("\n".join(lines), flush=True)


#: ``pgs run``'s options handed to torchrun as they are (their names are torchrun's).
RENDEZVOUS_OPTIONS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend", "master_addr", "master_port")


def _rendezvous(args):
    """torchrun's rendezvous options given to ``pgs run`` (``launch.Rendezvous``)."""
    from pgs.runtime.dist.launch import Rendezvous

    given = {k: getattr(args, k) for k in RENDEZVOUS_OPTIONS if getattr(args, k, None) is not None}
    return Rendezvous(**given)


def cmd_supervise(args) -> int:
    from pgs.runtime.tools.supervise import Policy, supervise

    spec = _load(args)
    if args.resume not in (None, "auto") and not os.path.exists(args.resume):
        raise SpecError(f"--resume: no such checkpoint: {args.resume}")
    if not args.backoff >= 0:
        raise SpecError(f"--backoff: expected seconds >= 0, got {args.backoff}")
    return supervise(spec, args.spec, overrides=args.overrides, resume=args.resume, overwrite=args.overwrite,
                     nproc=args.nproc, policy=Policy(retries=args.retries, backoff_s=args.backoff))


def cmd_validate(args) -> int:
    from pgs.runtime.tools.validate import validate

    return validate(_load(args), records=args.records, processes=args.nproc)


def cmd_report(args) -> int:
    from pgs.runtime.tools.report import write_report

    write_report(args.run_dir)
    return 0


def cmd_data_inspect(args) -> int:
    from pgs.runtime.tools.validate import inspect_spec

    return inspect_spec(_load(args), n=args.n, records=args.records)


def cmd_profile(args) -> int:
    from pgs.runtime.tools.profile import profile

    if args.measure and args.nproc > 1:
        raise SpecError(f"--measure runs the step on one process; drop --nproc {args.nproc} (the estimate "
                        "without --measure is one of N processes)")
    return int(profile(_load(args), measure=args.measure, spec_path=os.path.abspath(args.spec), ranks=args.nproc)
               or 0)


def cmd_prepare(args) -> int:
    from pgs.runtime.tools.prepare import prepare

    if args.replay is not None and not os.path.isfile(args.replay):
        raise SpecError(f"--replay: no such file: {args.replay}")
    return prepare(_load(args), args)
