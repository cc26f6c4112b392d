"""``pgs data inspect``: show samples with their trained tokens highlighted, and statistics.

The CLI command is wired by the lead; this module gives it :func:`inspect_dataset`.
"""

from __future__ import annotations

import itertools

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pgs.runtime import output
from pgs.runtime.data.config import DataConfig
from pgs.runtime.data.packing import Document
from pgs.runtime.data.kto import label_counts, read_kto_records
from pgs.runtime.data.preference import pack_rows, read_pairs
from pgs.runtime.data.readers import read_conversations
from pgs.runtime.data.stats import DataStats
from pgs.runtime.data.stream import encode_document, pack_documents

TRAINED_STYLE = "bold green on grey15"
CONTEXT_STYLE = "dim"
#: Around each run of trained tokens when the output is not a terminal (no colours to show them).
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def render_document(document: Document, tokenizer, plain: bool = False) -> Text:
    """The document's text, trained tokens highlighted, context dimmed; ``plain``: no styles,
    each run of trained tokens between ``[[`` and ``]]`` (for a file or a pipe)."""
    text = Text()
    if plain:
        for trained, run in itertools.groupby(zip(document.input_ids, document.train_mask), key=lambda x: x[1]):
            piece = tokenizer.decode([token for token, _ in run])
            text.append(f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}" if trained else piece)
        return text
    for token, trained in zip(document.input_ids, document.train_mask):
        text.append(tokenizer.decode([token]), style=TRAINED_STYLE if trained else CONTEXT_STYLE)
    return text


def dataset_stats(config: DataConfig, tokenizer, max_records: int | None = None,
                  shown: list[Document] | None = None, n_shown: int = 0, pack_window: int = 512) -> DataStats:
    """Tokenize every source (or its first ``max_records``) and pack as training would."""
    stats = DataStats()
    for source in config.sources:
        skipped: list[str] = []
        window: list[Document] = []
        conversations = read_conversations(source, None, config.on_bad_record, skipped)
        for count, conversation in enumerate(conversations):
            if max_records is not None and count >= max_records:
                break
            document = encode_document(conversation, tokenizer, config, stats)
            if document is None:
                continue
            if shown is not None and len(shown) < n_shown:
                shown.append(document)
            window.append(document)
            if len(window) == pack_window:
                _count_packing(window, config, stats)
                window = []
        _count_packing(window, config, stats)
        stats.bad_records += len(skipped)
    return stats


def _count_packing(window: list[Document], config: DataConfig, stats: DataStats) -> None:
    if window:
        sequences = pack_documents(window, config)
        stats.sequences += len(sequences)
        stats.sequence_capacity += len(sequences) * config.max_seq_len


def inspect_dataset(config: DataConfig, tokenizer, n: int = 5, console: Console | None = None,
                    max_records: int | None = None) -> DataStats:
    """Print the first ``n`` samples (trained tokens highlighted; between ``[[ ]]`` when the
    console is not a terminal) and the dataset statistics."""
    console = console or output.console()
    shown: list[Document] = []
    stats = dataset_stats(config, tokenizer, max_records, shown, n)
    for document in shown:
        trained = document.num_trained
        output.heading(console, f"{document.origin}  ({len(document)} tokens, {trained} trained)")
        plain = not console.is_terminal  # a pipe or file: one line per sample, never cut
        console.print(render_document(document, tokenizer, plain=plain), soft_wrap=plain)
    table = Table(title="data statistics", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in stats.summary():
        table.add_row(name, value)
    console.print(table)
    for warning in stats.warnings():
        console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    return stats


def inspect_pairs(config: DataConfig, tokenizer, n: int = 5, console: Console | None = None,
                  max_records: int | None = None, kto: bool = False) -> DataStats:
    """A preference run's data: the first ``n`` pairs, each arm with its scored tokens marked as
    :func:`inspect_dataset` marks trained tokens, then the pair statistics (bad pairs raise, or
    are counted under ``data.on_bad_record = "skip"``).  ``kto``: the data is KTO's unpaired
    records (``pgs.runtime.data.kto``), shown with their label and KL sample."""
    console = console or output.console()
    stats = DataStats()
    skipped: list[str] = []
    read = read_kto_records if kto else read_pairs
    pairs = read([s.path for s in config.sources], tokenizer, config, stats, skipped, max_records=max_records)
    for pair in pairs[:n]:
        arms = ((("desirable" if pair.desirable else "undesirable"), "KL sample") if kto else ("chosen", "rejected"))
        for arm, document in zip(arms, (pair.chosen, pair.rejected)):
            output.heading(console, f"{document.origin} {arm}  ({len(document)} tokens, {document.num_trained} scored)")
            plain = not console.is_terminal
            console.print(render_document(document, tokenizer, plain=plain), soft_wrap=plain)
    rows = pack_rows(pairs, config.max_seq_len)
    stats.sequences, stats.sequence_capacity = len(rows), len(rows) * config.max_seq_len
    unit = "records" if kto else "pairs"
    table = Table(title=f"{'KTO' if kto else 'preference'} data statistics", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row(unit, f"{len(pairs):,}")
    if kto:
        good, bad = label_counts(pairs)
        table.add_row("desirable / undesirable", f"{good:,} / {bad:,}")
    table.add_row(f"bad {unit} skipped", f"{len(skipped):,}")
    table.add_row("rows of max_seq_len (one epoch)", f"{len(rows):,}")
    table.add_row(f"{unit} per row", f"{len(pairs) / max(len(rows), 1):.2f}")
    table.add_row("scored tokens / tokens", f"{stats.trained_tokens:,} / {stats.tokens:,}")
    table.add_row("packing efficiency", f"{stats.packing_efficiency:.1%}")
    console.print(table)
    for message in skipped[:5]:
        console.print(f"skipped: {message}", markup=False, highlight=False, soft_wrap=True)
    return stats
