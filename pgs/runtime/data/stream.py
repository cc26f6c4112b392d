"""The training stream (mixed, packed, resumable) and the eval stream.

The training data is one deterministic stream of packed sequences.  It is built a *window*
at a time: ``pack_window`` documents (fewer where they reach the window's token budget,
``default_window_tokens``) are drawn from the mixed order (``sources``), tokenized,
packed best-fit-decreasing into sequences of ``max_seq_len``, and the sequences shuffled by
``(seed, window)``.  A batch is the next ``batch_size * world_size`` sequences of that global
stream; rank ``r`` keeps the ``r``-th slice of ``batch_size``.

The position in the stream is: the window number, the mixed order's counters at that
window's start, and how many of its sequences were taken.  Restoring rebuilds the window
from those counters (same draws, same packing) and skips the sequences already taken, so
the next batch after a resume is the one that would have come next, for any world size.
"""

from __future__ import annotations

import random
from typing import Iterator

from pgs.errors import DataError
from pgs.runtime.data.chat import empty_assistant_turns, encode_chat, encode_chats, weight_zero_turns
from pgs.runtime.data.config import DataConfig, DataSource
from pgs.runtime.data.packing import Document, PackedBatch, best_fit_decreasing, collate, pad_id
from pgs.runtime.data.readers import read_conversations
from pgs.runtime.data.records import Conversation
from pgs.runtime.data.sources import MixedOrder, SourceIndex
from pgs.runtime.data.stats import DataStats

STATE_VERSION = 1


def encode_document(conversation: Conversation, tokenizer, config: DataConfig, stats: DataStats) -> Document | None:
    """Tokenize one conversation and apply the length policy; ``None`` when it is dropped.

    Every outcome is counted in ``stats``: kept, truncated, dropped as too long, dropped for
    keeping no trained token, or (``on_bad_record="skip"``) a template that refused it.
    """
    try:
        encoded = encode_chat(
            tokenizer,
            conversation.content,
            conversation.tools,
            last_turn_only=config.last_turn_only,
            supervise_empty_think=config.supervise_empty_think,
            train_roles=config.train_roles,
        )
    except DataError as err:
        encoded = err
    return _document(conversation, encoded, config, stats)


def _document(conversation: Conversation, encoded, config: DataConfig, stats: DataStats) -> Document | None:
    """``encode_document``'s policy on an ``encode_chat`` result, or the exception it raised."""
    if isinstance(encoded, DataError):
        if config.on_bad_record != "skip":
            raise DataError(f"{conversation.origin}: {encoded}") from None
        stats.bad_records += 1
        return None
    if isinstance(encoded, BaseException):
        raise encoded
    ids, mask = encoded
    stats.records += 1
    stats.empty_assistant_turns += empty_assistant_turns(conversation.messages, config.last_turn_only)
    stats.weight_zero_turns += weight_zero_turns(conversation.messages, config.last_turn_only)
    if len(ids) > config.max_seq_len:
        if config.truncation == "drop":
            stats.dropped_too_long += 1
            return None
        ids, mask = ids[: config.max_seq_len], mask[: config.max_seq_len]
        stats.truncated += 1
    document = Document(tuple(ids), tuple(mask), conversation.origin)
    if document.num_trained == 0:
        stats.dropped_no_trained += 1
        return None
    stats.samples += 1
    stats.tokens += len(document)
    stats.trained_tokens += document.num_trained
    return document


#: a pack window's token budget: at least this many tokens (and 16 full rows) before a window
#: of fewer than ``pack_window`` documents closes
WINDOW_TOKENS = 2**20
WINDOW_ROWS = 16


def default_window_tokens(max_seq_len: int) -> int:
    """The tokens a pack window closes at when it has not reached ``pack_window`` documents.

    A window of ``pack_window`` documents is tokenized before its first sequence is trained;
    with documents of 100k tokens and more that is tens of millions of tokens and minutes
    before step 1 (held as Python ints: gigabytes), for no gain: packing best-fit needs a few
    rows' worth of choice, and a document as long as a row is its row.  Short chats never
    reach the budget (512 documents of 2,048 tokens are 2**20), so their windows are the same
    with and without it."""
    return max(WINDOW_TOKENS, WINDOW_ROWS * int(max_seq_len))


def pack_documents(documents: list[Document], config: DataConfig) -> list[list[Document]]:
    """Sequences of documents: best-fit-decreasing when packing, else one document each."""
    if not config.packing:
        return [[d] for d in documents]
    bins = best_fit_decreasing([len(d) for d in documents], config.max_seq_len)
    return [[documents[i] for i in b] for b in bins]


class TrainStream:
    """Batches of packed sequences from a weighted mix of sources, resumable exactly.

    ``next_batch(batch_size)`` returns this rank's ``PackedBatch``; ``state_dict()`` is
    JSON-serialisable (plain ints and strings) and ``load_state_dict()`` restores it.
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer,
        *,
        rank: int = 0,
        world_size: int = 1,
        pack_window: int = 512,
        window_tokens: int | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.config = config
        self.tokenizer = tokenizer
        self.rank = rank
        self.world_size = world_size
        self.pack_window = int(pack_window)
        self.window_tokens = (int(window_tokens) if window_tokens is not None
                              else default_window_tokens(config.max_seq_len))
        self.stats = DataStats()
        self._sources = [SourceIndex(s, config.on_bad_record, self.stats) for s in config.sources]
        self._order = MixedOrder([len(s) for s in self._sources], [s.weight for s in config.sources], config.seed)
        self._pad_id = pad_id(tokenizer)
        self._window = 0
        self._window_start = self._order.state_dict()
        self._sequences: list[list[Document]] | None = None
        self._taken = 0

    # -- the global stream -------------------------------------------------------------
    def _build_window(self, stats: DataStats) -> list[list[Document]]:
        documents: list[Document] = []
        misses = 0
        tokens = 0
        records = sum(len(s) for s in self._sources)
        config = self.config
        while len(documents) < self.pack_window and tokens < self.window_tokens:
            # Draw as many records as documents are missing (never more: each gives at most
            # one) and as the tokens still missing could need at max_seq_len each (so a window
            # of long documents stops at its token budget without drawing a record it then
            # leaves unused), tokenize them in one batch, then take the outcomes in draw order
            # exactly as one at a time would: the same counts, the same first error.
            rows_missing = -(-(self.window_tokens - tokens) // config.max_seq_len)
            draws = [self._order.next() for _ in range(min(self.pack_window - len(documents), rows_missing))]
            read: list = []
            for s, i in draws:
                try:
                    read.append(self._sources[s].read(i))
                except Exception as err:  # noqa: BLE001 - raised in its turn below
                    read.append(err)
            readable = [c for c in read if not isinstance(c, BaseException)]
            encoded = iter(encode_chats(
                self.tokenizer, [(c.content, c.tools) for c in readable],
                last_turn_only=config.last_turn_only, supervise_empty_think=config.supervise_empty_think,
                train_roles=config.train_roles,
            ))
            for (s, _), conversation in zip(draws, read):
                if isinstance(conversation, BaseException):
                    raise conversation
                document = _document(conversation, next(encoded), config, stats)
                if document is None:
                    misses += 1
                    if misses > records and not documents:
                        raise DataError(
                            f"{config.sources[s].path}: no record fits data.max_seq_len="
                            f"{config.max_seq_len} with a trained token ({stats.dropped} dropped)"
                        )
                    continue
                documents.append(document)
                tokens += len(document)
        sequences = pack_documents(documents, config)
        random.Random(f"{config.seed}:{self._window}").shuffle(sequences)
        stats.sequences += len(sequences)
        stats.sequence_capacity += len(sequences) * config.max_seq_len
        return sequences

    def _next_sequence(self) -> list[Document]:
        while self._sequences is None or self._taken >= len(self._sequences):
            if self._sequences is not None:
                self._window += 1
                self._taken = 0
                self._window_start = self._order.state_dict()
            self._sequences = self._build_window(self.stats)
        sequence = self._sequences[self._taken]
        self._taken += 1
        return sequence

    # -- public ------------------------------------------------------------------------
    def next_batch(self, batch_size: int) -> PackedBatch:
        """This rank's share of the next ``batch_size * world_size`` packed sequences, as a
        ``[batch_size, data.max_seq_len]`` batch (padded to the full length)."""
        rows = [self._next_sequence() for _ in range(batch_size * self.world_size)]
        mine = rows[self.rank * batch_size:(self.rank + 1) * batch_size]
        # always max_seq_len wide: one shape for every step, so compiled layers and kernel plans
        # are built once (rows padded to their batch's longest recompiled at every new width)
        return collate(mine, self._pad_id, seq_len=self.config.max_seq_len)

    def __iter__(self) -> Iterator[list[Document]]:
        """The global stream of packed sequences (each a list of documents), endless."""
        while True:
            yield self._next_sequence()

    @property
    def epoch(self) -> int:
        """Complete passes over every source, counted in documents drawn for packing."""
        return self._order.epoch

    def _fingerprint(self) -> dict:
        c = self.config
        return {
            "sources": [f"{s.path}|{s.format}|{s.weight!r}|{len(i)}"
                        + "".join(f"|{k}={v}" for k, v in s.fields().items())
                        for s, i in zip(c.sources, self._sources)],
            "content": [i.digest for i in self._sources],  # each source's bytes (sources.content_digest)
            "seed": c.seed,
            "max_seq_len": c.max_seq_len,
            "packing": c.packing,
            "truncation": c.truncation,
            "last_turn_only": c.last_turn_only,
            "supervise_empty_think": c.supervise_empty_think,
            "pack_window": self.pack_window,
            **({"window_tokens": self.window_tokens}
               if self.window_tokens != default_window_tokens(c.max_seq_len) else {}),
            "chat_template": c.chat_template,
            # only when not the default, so that checkpoints from before the field still resume
            **({"train_roles": list(c.train_roles)} if c.train_roles != ("assistant",) else {}),
        }

    def state_dict(self) -> dict:
        """The stream position: plain ints and strings (JSON-serialisable)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "window": self._window,
            "window_start": dict(self._window_start),
            "taken": self._taken if self._sequences is not None else 0,
            "built": self._sequences is not None,
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Return to a saved position; the next batch is the one that would have come next."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state: version {state.get('version')!r}, expected {STATE_VERSION}")
        saved, current = state["fingerprint"], self._fingerprint()
        # "content": checkpoints written before the content digest resume on the rest
        changed = sorted(k for k in current if saved.get(k) != current[k] and (k != "content" or k in saved))
        if changed == ["content"]:  # the same files, counts and settings; different bytes
            edited = [s.path for s, old, new in zip(self.config.sources, saved["content"], current["content"])
                      if old != new]
            raise DataError(
                f"data state: {', '.join(edited)}: the content changed since the checkpoint (the same "
                "records count, other bytes); a resume would not continue the same data: restore the "
                "file, or start a new run (--overwrite, or another checkpoint.dir)"
            )
        if changed:
            raise DataError(
                "data state: the data changed since the checkpoint (" + ", ".join(changed) + "); "
                "a resume would not continue the same stream"
            )
        self._window = int(state["window"])
        self._window_start = dict(state["window_start"])
        self._order.load_state_dict(self._window_start)
        self._sequences = None
        self._taken = 0
        if state["built"]:
            self._sequences = self._build_window(DataStats())
            self._taken = int(state["taken"])
        self.stats.load(state["stats"])


class EvalStream:
    """Batches of eval samples in file order, one document per row, one pass.

    With ``world_size > 1`` every rank gets the same number of batches (a rank short of
    samples gets all-padding rows), so that no rank leaves an eval loop its peers are in.
    """

    def __init__(self, config: DataConfig, tokenizer, batch_size: int, *, path: str | None = None,
                 rank: int = 0, world_size: int = 1):
        path = path or config.eval
        if path is None:
            raise DataError("data.eval: no eval file is configured")
        self.config = config
        self.tokenizer = tokenizer
        self.path = path
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.stats = DataStats()
        self._pad_id = pad_id(tokenizer)

    def documents(self) -> Iterator[Document]:
        skipped: list[str] = []
        for conversation in read_conversations(DataSource(self.path), None, self.config.on_bad_record, skipped):
            document = encode_document(conversation, self.tokenizer, self.config, self.stats)
            if document is not None:
                yield document
        self.stats.bad_records += len(skipped)

    def __iter__(self) -> Iterator[PackedBatch]:
        step = self.batch_size * self.world_size
        pending: list[Document] = []
        for document in self.documents():
            pending.append(document)
            if len(pending) == step:
                yield self._share(pending)
                pending = []
        if pending:
            yield self._share(pending)

    def _share(self, documents: list[Document]) -> PackedBatch:
        mine = documents[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        rows = [[d] for d in mine] + [[] for _ in range(self.batch_size - len(mine))]
        return collate(rows, self._pad_id)
