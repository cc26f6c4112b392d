"""Looking before training: ``pgs validate SPEC`` (every check ``pgs run`` makes before its first
step, then the data, and a summary of what the run would be) and ``pgs data inspect SPEC`` (the
samples as the run will see them).  docs/cli.md."""

from __future__ import annotations

from rich.table import Table

from pgs.runtime import output
from pgs.runtime.data.inspect import inspect_dataset, inspect_pairs
from pgs.runtime.data.templates import apply_chat_template
from pgs.runtime.model.loading import load_tokenizer
from pgs.runtime.spec.preflight import check_resources


def validate(spec, records: int = 200, processes: int | None = None) -> int:
    """Check ``spec`` (its model, tokenizer, run folder and the first ``records`` records of each
    data file; 0 reads all) for ``processes`` processes (``--nproc``; None: not given) and print
    the summary; a problem raises its ``PgsError``."""
    print_summary(spec, check_resources(spec, records=records, processes=processes))
    return 0


def inspect_spec(spec, n: int = 5, records: int = 0) -> int:
    """The first ``n`` samples with their trained tokens marked, then statistics of the data
    (``records`` per source; 0: all), tokenised by the spec's own tokenizer."""
    tokenizer = apply_chat_template(load_tokenizer(spec.model.tokenizer, spec.model.trust_remote_code),
                                    spec.data.chat_template)
    if spec.preference is not None:
        inspect_pairs(spec.data, tokenizer, n=n, max_records=records or None, kto=spec.preference.kind == "kto")
    else:
        inspect_dataset(spec.data, tokenizer, n=n, max_records=records or None)
    return 0


def _named(spec, field: str, path: str) -> str:
    """A folder as the summary shows it: a hub name with its commit and the cache's folder."""
    source = spec.hub.get(field)
    return path if source is None else f"{source.repo} at revision {source.revision[:12]} ({source.path})"


def print_summary(spec, facts: dict) -> None:
    """The summary table of a runnable spec, then its warnings."""
    console = output.console()
    table = Table(title=f"pgs validate: {spec.source}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    m, t, s = spec.model, spec.train, spec.schedule
    table.add_row("model", _named(spec, "model.path", m.path or "random init") + f"  [{facts.get('model', '')}]")
    if "weights" in facts:
        table.add_row("weights", facts["weights"])
    table.add_row("parameters", facts.get("parameters", "?")
                  + (f", frozen {facts['frozen']}" if "frozen" in facts else ""))
    table.add_row("dtype / attention", f"{m.dtype} / {m.attn_implementation}"
                  + (f" ({m.varlen_kernel} kernel)" if m.varlen_kernel != "auto" else "")
                  + (f" / experts {m.experts_implementation}" if m.experts_implementation != "auto" else ""))
    own = m.path is not None and m.tokenizer == m.path
    tokenizer = (_named(spec, "model.path", m.path) + ", the model's own" if own
                 else _named(spec, "model.tokenizer", m.tokenizer))
    table.add_row("tokenizer", f"{tokenizer}  [{facts.get('tokenizer', '')}]")
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
    if "preference" in facts:
        table.add_row("preference", facts["preference"])
        table.add_row("records" if spec.preference.kind == "kto" else "pairs", facts["pairs"])
    elif "distill" in facts:
        table.add_row("distill", facts["distill"])
    else:
        table.add_row("loss", f"{spec.loss.objective} ({spec.loss.backend})")
    length = f"{t.steps} steps" if t.steps is not None else f"{t.epochs} epochs"
    table.add_row("train", f"{length}, batch {t.batch_size} × {spec.data.max_seq_len} tokens, "
                           f"grad_accum {t.grad_accum}, device {t.device}")
    if "memory" in facts:
        table.add_row("memory", facts["memory"])
    table.add_row("run folder", spec.run_dir)
    console.print(table)
    for warning in facts["warnings"] + (stats.warnings() if stats is not None else []):
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    console.print("[green]ok[/]: the spec is runnable")
