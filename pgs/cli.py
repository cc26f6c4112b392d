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

from pgs.errors import EXIT_BAD_INPUT, DataError, PgsError, SpecError

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
    from pgs.runtime.spec import load_spec

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
        from pgs.runtime.trace import parse_steps

        profile = parse_steps(args.profile)
    train = _component("pgs.runtime.train", "pgs run")
    extra = {"overwrite": True} if args.overwrite else {}
    return int(train.run(spec, resume=args.resume, spec_path=os.path.abspath(args.spec), profile=profile,
                         **extra) or 0)


def cmd_validate(args) -> int:
    spec = _load(args)
    found = check_resources(spec, records=args.records)
    print_summary(spec, found)
    return 0


def cmd_report(args) -> int:
    from pgs.runtime.report import write_report

    write_report(args.run_dir)
    return 0


def cmd_data_inspect(args) -> int:
    spec = _load(args)
    inspect = _component("pgs.runtime.data.inspect", "pgs data inspect")
    tokenizer = load_tokenizer(spec.model)
    inspect.inspect_dataset(spec.data, tokenizer, n=args.n, max_records=args.records or None)
    return 0


def cmd_profile(args) -> int:
    spec = _load(args)
    profile = None
    for module in ("pgs.runtime.profile", "pgs.runtime.train"):
        try:
            profile = getattr(_component(module, "pgs profile"), "profile", None)
        except NotAvailable:
            continue
        if profile is not None:
            break
    if profile is None:
        raise NotAvailable("pgs profile needs pgs.runtime.profile, which is not part of this installation yet")
    return int(profile(spec, measure=args.measure, spec_path=os.path.abspath(args.spec)) or 0)


# --------------------------------------------------------------------------- pgs run --nproc


def _launch_torchrun(args, spec) -> int:
    """Relaunch ``pgs run`` under torchrun with ``--nproc`` processes; return the run's verdict.

    ``launch.relaunch``: signals to this process are passed on to the workers (which
    checkpoint and stop together); torchrun collapses every worker's exit code to 1, so a
    ``HALT.json`` written during this launch decides the code, else 128+signum after a
    forwarded signal, else torchrun's.
    """
    from pgs.runtime.launch import relaunch
    from pgs.runtime.spec import check_world_size

    check_world_size(spec.train, args.nproc)  # refuse before starting N processes
    if args.resume is None:  # refuse (or move the old run aside) once, before N processes start
        from pgs.runtime import checkpoint

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
    return relaunch(args.nproc, forwarded, run_dir=spec.run_dir)


# --------------------------------------------------------------------------- pgs validate


def _quiet_transformers() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_tokenizer(model):
    """The tokenizer of ``model.tokenizer`` (a local folder); ``SpecError`` when it will not load."""
    _quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model.tokenizer, local_files_only=True, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = _first_line(err)
        raise SpecError(f"model.tokenizer: cannot load a tokenizer from {model.tokenizer} ({first})") from None


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _model_config(model, vocab_size: int):
    from transformers import AutoConfig

    from pgs.runtime.spec import suggest

    try:
        if model.path is not None:
            return AutoConfig.from_pretrained(model.path, local_files_only=True,
                                              trust_remote_code=model.trust_remote_code)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        table = dict(model.config)
        model_type = table.pop("model_type")
        if model_type not in CONFIG_MAPPING:
            known = list(CONFIG_MAPPING.keys())
            raise SpecError(f"model.config.model_type: unknown architecture {model_type!r}"
                            f"{suggest(model_type, known) or ' (see transformers model types)'}")
        if not table.get("vocab_size"):
            table["vocab_size"] = vocab_size
        config = AutoConfig.for_model(model_type, **table)
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = _first_line(err)
        field = "model.path" if model.path is not None else "model.config"
        raise SpecError(f"{field}: not a usable model configuration ({first})") from None
    from pgs.runtime.attention import hf_implementation

    config._attn_implementation = hf_implementation(model.attn_implementation, config)  # "auto" resolved
    return config


def _parameter_names(config, trust_remote_code: bool) -> dict[str, tuple[int, ...]] | None:
    """Parameter names and shapes of the architecture, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # an architecture that cannot build on meta: the run will say more
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _dummy_params():
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g),
    }


def _check_chain(spec) -> str:
    """Build the chain and take two steps on a tiny parameter tree; returns its description."""
    import torch

    import pgs.func as pf

    total = spec.train.steps or 100
    chain = spec.build_chain(total_steps=total)
    params = _dummy_params()
    opt = pf.compile(chain, jit=False) if spec.optimizer.compile else chain
    try:
        state = opt.init(params)
        for _ in range(2):
            grads = {k: torch.randn_like(v) for k, v in params.items()}
            updates, state = opt.update(grads, state, params)
            params = pf.apply_updates(params, updates)
    except PgsError as err:
        raise SpecError(f"optimizer: the chain fails on a test parameter tree ({err})") from None
    bad = [k for k, v in params.items() if not torch.isfinite(v).all()]
    if bad:
        raise SpecError(f"optimizer: the chain produced non-finite values on a test parameter tree ({bad[0]})")
    o = spec.optimizer
    if o.chain is not None:
        text = " → ".join(e.name for e in o.chain)
    else:
        args = ", ".join(f"{k}={v}" for k, v in o.args.items())
        text = (f"clip_by_global_norm({o.clip:g}) → " if o.clip > 0 else "") + f"{o.alias}({args})"
    return text + (" (compiled)" if o.compile else "")


def _check_eval(spec, tokenizer, records: int) -> int:
    from pgs.runtime.data import DataStats, encode_document, read_conversations

    stats = DataStats()
    count = 0
    for count, conversation in enumerate(read_conversations(spec.data.eval, "auto", "error"), start=1):
        encode_document(conversation, tokenizer, spec.data, stats)
        if records and count >= records:
            break
    if count == 0:
        raise SpecError(f"data.eval: {spec.data.eval} has no records")
    return count


def check_resources(spec, records: int = 200) -> dict:
    """What ``pgs validate`` checks beyond the spec itself; returns facts for the summary.

    Loads the tokenizer, resolves the model configuration (vocabulary, freeze patterns,
    packing isolation), runs the chain on a tiny tree and reads the first ``records``
    records of every data file through the data pipeline.  Problems raise ``SpecError`` or
    ``DataError``; ``facts["warnings"]`` holds what is worth saying but not fatal.
    """
    import re

    from pgs.runtime.data.inspect import dataset_stats
    from pgs.runtime.data.records import iter_lines
    from pgs.runtime.data.isolation import require_packing_isolation

    facts: dict = {"warnings": []}
    tokenizer = load_tokenizer(spec.model)
    facts["tokenizer"] = f"{len(tokenizer)} tokens"
    config = _model_config(spec.model, len(tokenizer))
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        field = "model.config.vocab_size" if spec.model.config is not None else "model.path"
        raise SpecError(f"{field}: the model has {vocab} embeddings but the tokenizer has {len(tokenizer)} tokens")
    facts["model"] = f"{config.model_type}, vocab {vocab}"
    shapes = _parameter_names(config, spec.model.trust_remote_code)
    if shapes is None:
        facts["warnings"].append("the architecture could not be built on the meta device; parameters not counted")
    else:
        total = sum(_numel(s) for s in shapes.values())
        facts["parameters"] = f"{total / 1e6:,.2f} M"
        if isinstance(spec.model.freeze, tuple):
            for i, pattern in enumerate(spec.model.freeze):
                if not any(re.search(pattern, name) for name in shapes):
                    raise SpecError(f"model.freeze[{i}]: {pattern!r} matches no parameter of the model")
            frozen = [n for n in shapes if any(re.search(p, n) for p in spec.model.freeze)]
            if len(frozen) == len(shapes):
                raise SpecError("model.freeze: these patterns freeze every parameter; nothing would train")
            facts["frozen"] = f"{sum(_numel(shapes[n]) for n in frozen) / 1e6:,.2f} M in {len(frozen)} tensors"
    if spec.data.packing:
        verdict = require_packing_isolation(config, spec.data.allow_packing_leakage)
        if not verdict.isolates:
            facts["warnings"].append(f"packing leaks across documents: {verdict.reason}")
    facts["chain"] = _check_chain(spec)
    for i, source in enumerate(spec.data.sources):
        if next(iter_lines(source.path), None) is None:
            raise DataError(f"{source.path}: no records (data.sources[{i}] is empty)")
    stats = dataset_stats(spec.data, tokenizer, max_records=records or None)
    if stats.samples == 0:
        raise SpecError("data.sources: no record of the data checked keeps a trained token within "
                        f"max_seq_len = {spec.data.max_seq_len} (see pgs data inspect)")
    facts["data"] = stats
    if stats.dropped:
        facts["warnings"].append(
            f"{stats.dropped} of the {stats.records} records checked would be dropped "
            f"({stats.dropped_too_long} too long, {stats.dropped_no_trained} without a trained token)"
        )
    if spec.data.eval is not None:
        facts["eval"] = f"{_check_eval(spec, tokenizer, records)} records checked"
    return facts


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


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
