"""Preference pairs: reading, chat masks, pair packing and the resumable pair stream.

Accepted record shapes (one JSON object per line; other keys ride along):

* ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``: the prompt is the
  shared conversation so far, each arm the turns that follow it (usually one assistant message);
* ``{"chosen": [messages], "rejected": [messages]}``: two whole conversations that share a
  prefix; the prompt is their common leading messages, and they must first differ at an
  assistant message (otherwise the arms answer different prompts);
* ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: plain strings, a user turn and an
  assistant reply each.  An arm given as a string is one assistant message in any shape.

``tools`` (a list of objects) is shared by both arms.  Each arm is rendered with the chat
template as in SFT (``chat.assistant_spans``) and only the arm's own assistant turns are
trained (the prompt's assistant turns, in a multi-turn prompt, are context).  A bad pair is a
``DataError`` of one line, ``file:line: problem``, and follows ``data.on_bad_record``:
identical arms, an empty arm, arms whose prompts differ, a pair longer than
``data.max_seq_len`` (both arms together: they share a row).

Packing: the two arms of a pair are two documents of one row (positions restart at each, as
in SFT packing, so they never see each other) and a pair is never split across rows; rows are
filled with whole pairs in the epoch's order.  A :class:`PreferenceBatch` carries ``seq_ids``
(``[B, S]``: ``2k`` for the chosen arm of the batch's ``k``-th pair, ``2k + 1`` for its rejected
arm, ``-1`` for padding) and ``pair_ids`` (``[P]``: each pair's index in the data, the key of the
reference cache).

KTO's unpaired records (``pgs.runtime.data.kto``) travel in the same shapes: a :class:`Pair`
whose ``chosen`` is the record's completion, ``rejected`` the mismatched completion of its KL
estimate, and ``desirable`` the record's label (None for a preference pair); a batch of them
carries ``desirable`` ``[P]``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Iterator, Sequence

import attrs
import numpy as np
import torch

from pgs.errors import DataError
from pgs.runtime.data.chat import tokenize_texts, assistant_spans, is_empty_turn, train_mask
from pgs.runtime.data.config import DataConfig
from pgs.runtime.data.packing import Document, collate, pad_id
from pgs.runtime.data.readers import open_reader
from pgs.runtime.data.records import RecordProblem, decode_object, parse_message
from pgs.runtime.data.stats import DataStats

STATE_VERSION = 1


@attrs.frozen
class PairRecord:
    """A validated pair: the shared prompt, each arm's own messages, tools, ``file:line``."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    origin: str


@attrs.frozen
class Pair:
    """A tokenized pair: two documents (the arms) and the pair's index in the data.  A KTO record
    (``pgs.runtime.data.kto``) is one too: its completion, the mismatched completion, its label."""

    chosen: Document
    rejected: Document
    index: int
    desirable: bool | None = None

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def messages_of(value: Any, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}] if key != "prompt" else [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise RecordProblem(f"'{key}' must be a string or a list of messages, got {type(value).__name__}")
    try:
        return [parse_message(m, i) for i, m in enumerate(value)]
    except RecordProblem as err:
        raise RecordProblem(f"'{key}' {err}") from None


def arm_is_empty(messages: list[dict]) -> bool:
    return not messages or all(is_empty_turn(m) or (m["role"] != "assistant" and not m["content"].strip())
                               for m in messages)


def parse_pair(record: Any) -> tuple[list[dict], list[dict], list[dict], list[dict] | None]:
    """``(prompt, chosen, rejected, tools)`` of one decoded record, or ``RecordProblem``."""
    if not isinstance(record, dict):
        raise RecordProblem(f"expected a JSON object per line, got {type(record).__name__}")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise RecordProblem(f"missing '{key}' (a preference pair needs 'chosen' and 'rejected')")
    chosen, rejected = messages_of(record["chosen"], "chosen"), messages_of(record["rejected"], "rejected")
    if "prompt" in record:
        prompt = messages_of(record["prompt"], "prompt")
        if not prompt:
            raise RecordProblem("'prompt' is empty")
    else:  # whole conversations: the prompt is their shared prefix
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared < min(len(chosen), len(rejected)):
            c, r = chosen[shared], rejected[shared]
            if c["role"] != "assistant" or r["role"] != "assistant":
                raise RecordProblem(
                    f"the prefixes of 'chosen' and 'rejected' differ at message {shared} "
                    f"({c['role']} vs {r['role']}): the arms must answer the same prompt")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise RecordProblem("'chosen' and 'rejected' share no prompt (no 'prompt' key and no common first "
                                "message)")
    for key, arm in (("chosen", chosen), ("rejected", rejected)):
        if arm_is_empty(arm):
            raise RecordProblem(f"'{key}' is empty (no assistant reply to score)")
        if arm[0]["role"] != "assistant":
            raise RecordProblem(f"'{key}' must start with an assistant message, got {arm[0]['role']}")
    if chosen == rejected:
        raise RecordProblem("'chosen' and 'rejected' are identical")
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RecordProblem("'tools' must be a list of objects")
    return prompt, chosen, rejected, (tools or None)


def parse_pair_line(line: str | bytes, origin: str) -> PairRecord:
    """Decode and validate one JSONL line; ``DataError('file:line: problem')`` when it is bad."""
    return pair_record(decode_object(line, origin), origin)


def pair_record(record: Any, origin: str) -> PairRecord:
    """Validate one decoded pair; ``DataError('origin: problem')`` when it is bad."""
    try:
        prompt, chosen, rejected, tools = parse_pair(record)
    except RecordProblem as err:
        raise DataError(f"{origin}: {err}") from None
    return PairRecord(prompt, chosen, rejected, tools, origin)


def encode_arm(tokenizer, prompt: list[dict], arm: list[dict], tools,
               config: DataConfig) -> tuple[list[int], list[bool]]:
    """Token ids and train mask of ``prompt + arm``: the arm's assistant turns only (SFT's masks)."""
    messages = prompt + arm
    text, spans = assistant_spans(tokenizer, messages, tools, supervise_empty_think=config.supervise_empty_think)
    # assistant_spans gives one span per non-empty assistant turn, in order: the prompt's come first
    skip = sum(m["role"] == "assistant" and not is_empty_turn(m) for m in prompt)
    ((ids, offsets),) = tokenize_texts(tokenizer, [text])
    return list(ids), train_mask(offsets, spans[skip:]).tolist()


def encode_pair(record: PairRecord, tokenizer, config: DataConfig, index: int) -> Pair:
    """The tokenized pair; ``DataError`` (with ``file:line``) for an arm that trains nothing or a
    pair longer than ``data.max_seq_len``."""
    docs = []
    for key, arm in (("chosen", record.chosen), ("rejected", record.rejected)):
        try:
            ids, mask = encode_arm(tokenizer, record.prompt, arm, record.tools, config)
        except DataError as err:
            raise DataError(f"{record.origin}: '{key}': {err}") from None
        doc = Document(tuple(ids), tuple(mask), record.origin)
        if doc.num_trained == 0:
            raise DataError(f"{record.origin}: '{key}' is empty after the chat template (no trained token)")
        docs.append(doc)
    chosen, rejected = docs
    if chosen.input_ids == rejected.input_ids:
        raise DataError(f"{record.origin}: 'chosen' and 'rejected' are identical after the chat template")
    total = len(chosen) + len(rejected)
    if total > config.max_seq_len:
        raise DataError(f"{record.origin}: the pair is {total} tokens (chosen {len(chosen)} + rejected "
                        f"{len(rejected)}), longer than data.max_seq_len = {config.max_seq_len}")
    return Pair(chosen, rejected, index)


def read_pairs(paths: Sequence[str], tokenizer, config: DataConfig, stats: DataStats | None = None,
               skipped: list[str] | None = None, max_records: int | None = None) -> list[Pair]:
    """Every good pair of ``paths``, in file order, indexed 0, 1, ... in that order.

    A bad pair raises its ``DataError`` (``data.on_bad_record = "error"``) or is left out,
    counted in ``stats.bad_records`` and its message appended to ``skipped`` (``"skip"``).
    ``max_records``: read at most that many records per file (``pgs validate``)."""
    stats = stats if stats is not None else DataStats()
    pairs: list[Pair] = []
    for path in paths:
        reader = open_reader(path)  # any source an SFT run reads (JSONL, JSON, Parquet, Arrow, datasets)
        for count, (_, label, raw) in enumerate(reader.scan(), start=1):
            if max_records is not None and count > max_records:
                break
            origin = reader.origin(label)
            try:
                pair = encode_pair(pair_record(reader.record(raw, origin), origin), tokenizer, config, len(pairs))
            except DataError as err:
                if config.on_bad_record != "skip":
                    raise
                stats.bad_records += 1
                if skipped is not None:
                    skipped.append(str(err))
                continue
            stats.records += 1
            stats.samples += 1
            stats.tokens += len(pair)
            stats.trained_tokens += pair.chosen.num_trained + pair.rejected.num_trained
            pairs.append(pair)
        reader.close()
    return pairs


@attrs.frozen
class PreferenceBatch:
    """Rows of packed pairs: ``PackedBatch``'s tensors plus ``seq_ids`` ``[B, S]`` (the document
    of each position: ``2k``/``2k + 1`` for the chosen/rejected arm of the batch's ``k``-th pair,
    ``-1`` for padding) and ``pair_ids`` ``[P]`` (each pair's index in the data)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    pair_ids: torch.Tensor
    cu_seqlens: list[torch.Tensor]
    num_docs: int
    num_pairs: int
    num_trained_tokens: int
    num_tokens: int
    desirable: torch.Tensor | None = None  # [P] bool: KTO records' labels (None for preference pairs)


def collate_pairs(rows: Sequence[Sequence[Pair]], pad_id: int, seq_len: int | None = None) -> PreferenceBatch:
    """Each row's pairs as documents ``chosen, rejected, chosen, rejected, ...`` (``packing.collate``)."""
    packed = collate([[doc for p in row for doc in (p.chosen, p.rejected)] for row in rows], pad_id, seq_len)
    seq_ids = np.full(tuple(packed.input_ids.shape), -1, dtype=np.int64)
    k = 0
    for r, row in enumerate(rows):
        at = 0
        for pair in row:
            for doc in (pair.chosen, pair.rejected):
                seq_ids[r, at:at + len(doc)] = k
                at += len(doc)
                k += 1
    pair_ids = torch.tensor([p.index for row in rows for p in row], dtype=torch.long)
    marks = [p.desirable for row in rows for p in row]
    desirable = torch.tensor(marks, dtype=torch.bool) if marks and marks[0] is not None else None
    return PreferenceBatch(
        input_ids=packed.input_ids, labels=packed.labels, position_ids=packed.position_ids,
        seq_ids=torch.from_numpy(seq_ids), pair_ids=pair_ids, cu_seqlens=packed.cu_seqlens,
        num_docs=packed.num_docs, num_pairs=len(pair_ids), num_trained_tokens=packed.num_trained_tokens,
        num_tokens=packed.num_tokens, desirable=desirable,
    )


def pack_rows(pairs: Sequence[Pair], capacity: int) -> list[list[Pair]]:
    """Whole pairs into rows of ``capacity`` tokens, in order: a pair that does not fit opens the next row."""
    rows: list[list[Pair]] = []
    used = capacity + 1
    for pair in pairs:
        if used + len(pair) > capacity:
            rows.append([])
            used = 0
        rows[-1].append(pair)
        used += len(pair)
    return rows


class PreferenceStream:
    """The training pairs, epoch after epoch, in an order shuffled by ``(data.seed, epoch)``,
    packed into ``[batch_size, max_seq_len]`` rows; resumable exactly.

    Every pair is read and tokenized once, when the stream is made (the reference log-probs
    need all of them before training anyway).  The position is ``(epoch, cursor)``: the next
    pair of that epoch's order; ``state_dict()`` is JSON-serialisable and ``load_state_dict()``
    checks that the data is the same (the number of pairs and their tokens).
    """

    def __init__(self, config: DataConfig, tokenizer, *, rank: int = 0, world_size: int = 1,
                 pairs: list[Pair] | None = None, read=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.config = config
        self.tokenizer = tokenizer
        self.rank, self.world_size = rank, world_size
        self.stats = DataStats()
        self.skipped: list[str] = []
        if pairs is None:
            # ``read``: another reader of the same signature (KTO's ``read_kto_records``)
            pairs = (read or read_pairs)([s.path for s in config.sources], tokenizer, config, self.stats,
                                         self.skipped)
        else:
            self.stats.samples = len(pairs)
        if not pairs:
            raise DataError(f"{config.sources[0].path}: no usable preference pair")
        self.pairs = pairs
        self._pad_id = pad_id(tokenizer)
        self._epoch = 0
        self._cursor = 0
        self._order = self._order_of(0)
        self._digest = _digest(pairs)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.pairs)))
        random.Random(f"{self.config.seed}:pairs:{epoch}").shuffle(order)
        return order

    def _next_row(self) -> list[Pair]:
        row: list[Pair] = []
        used = 0
        while True:
            if self._cursor >= len(self._order):
                self._epoch += 1
                self._cursor = 0
                self._order = self._order_of(self._epoch)
            pair = self.pairs[self._order[self._cursor]]
            if row and used + len(pair) > self.config.max_seq_len:
                return row
            row.append(pair)
            used += len(pair)
            self._cursor += 1

    def next_batch(self, batch_size: int) -> PreferenceBatch:
        """This rank's share of the next ``batch_size * world_size`` rows, ``max_seq_len`` wide."""
        rows = [self._next_row() for _ in range(batch_size * self.world_size)]
        self.stats.sequences += len(rows)
        self.stats.sequence_capacity += len(rows) * self.config.max_seq_len
        mine = rows[self.rank * batch_size:(self.rank + 1) * batch_size]
        return collate_pairs(mine, self._pad_id, seq_len=self.config.max_seq_len)

    @property
    def epoch(self) -> int:
        return self._epoch

    def rows_per_epoch(self) -> int:
        """Rows one pass over the pairs fills (in index order; an epoch's shuffle changes it a little)."""
        return len(pack_rows(self.pairs, self.config.max_seq_len))

    def _fingerprint(self) -> dict:
        c = self.config
        return {"pairs": len(self.pairs), "digest": self._digest, "seed": c.seed, "max_seq_len": c.max_seq_len}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "fingerprint": self._fingerprint(), "epoch": self._epoch,
                "cursor": self._cursor, "stats": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or "cursor" not in state:
            raise DataError(f"data state: not a preference stream's position (version {state.get('version')!r})")
        saved, current = state["fingerprint"], self._fingerprint()
        changed = sorted(k for k in current if saved.get(k) != current[k])
        if changed:
            raise DataError("data state: the preference data changed since the checkpoint ("
                            + ", ".join(changed) + "); a resume would not continue the same stream")
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._order_of(self._epoch)
        self.stats.load(state["stats"])


def _digest(pairs: Sequence[Pair]) -> str:
    h = hashlib.sha256()
    for p in pairs:
        for doc in (p.chosen, p.rejected):
            h.update(np.asarray(doc.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(doc.train_mask, dtype=np.bool_).tobytes())
            h.update(b"|")
        if p.desirable is not None:  # a KTO record's label is part of its data
            h.update(b"+" if p.desirable else b"-")
    return h.hexdigest()[:16]


def eval_batches(pairs: Sequence[Pair], tokenizer, config: DataConfig, rows: int = 8) -> Iterator[PreferenceBatch]:
    """The held-out pairs in file order, rows filled with whole pairs, ``rows`` rows a batch (one pass)."""
    pad = pad_id(tokenizer)
    packed = pack_rows(pairs, config.max_seq_len)
    for at in range(0, len(packed), rows):
        yield collate_pairs(packed[at:at + rows], pad, seq_len=None)
