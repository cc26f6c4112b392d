"""KTO's unpaired data: records of one prompt, one completion and a desirable/undesirable label.

Accepted record shapes (one JSON object per line, or a row of any source an SFT run reads; other
keys ride along), TRL's unpaired preference format:

* ``{"prompt": "...", "completion": "...", "label": true}``: plain strings, a user turn and an
  assistant reply;
* ``{"prompt": [messages], "completion": [messages], "label": false}``: the conversation so far
  and the turns that answer it (usually one assistant message);
* ``{"messages": [messages], "label": true}``: a whole conversation; its trailing assistant
  messages are the completion, what comes before them the prompt.

``label`` is a JSON boolean (true: desirable); ``tools`` (a list of objects) as in SFT.  Only the
completion's assistant turns are scored (SFT's masks, ``chat.assistant_spans``).  A bad record is
a ``DataError`` of one line, ``file:line: problem``, and follows ``data.on_bad_record``: a
missing or non-boolean label, an empty completion, a record with ``chosen``/``rejected`` (a
pair: ``kind = "dpo"`` reads it), a record too long for ``data.max_seq_len`` with its KL sample.

The KL sample (the reference point z_ref, ``pgs.func.losses.kto``): KTO estimates the policy's
KL from the reference over *mismatched* prompt/completion pairs.  Each record i is given the
completion of another record σ(i) — σ follows a shuffle of the records seeded by ``data.seed``
(record order[k] takes the completion of order[k + 1], the last the first's), fixed when the data
is read so that the reference's log-prob of the mismatched pair can be cached with the record's
own.  The record becomes a :class:`~pgs.runtime.data.preference.Pair`: ``chosen`` is the prompt
with its completion, ``rejected`` the same prompt with σ(i)'s completion (cut to the room left
in the row: the estimate needs a completion of the data, not a whole one), ``desirable`` its
label.  Both documents share a row (``data.max_seq_len`` bounds their sum), so the stream,
packing, reference cache and evaluation of ``[preference]`` carry KTO unchanged.
"""

from __future__ import annotations

import json
import random
from typing import Any, Sequence

import attrs

from pgs.errors import DataError
from pgs.runtime.data.config import DataConfig
from pgs.runtime.data.packing import Document
from pgs.runtime.data.preference import Pair, arm_is_empty, encode_arm, messages_of
from pgs.runtime.data.readers import open_reader
from pgs.runtime.data.records import RecordProblem
from pgs.runtime.data.stats import DataStats


@attrs.frozen
class KTORecord:
    """A validated KTO record: the prompt, the completion's messages, the label, tools, ``file:line``."""

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    desirable: bool
    tools: list[dict[str, Any]] | None
    origin: str


def parse_kto(record: Any) -> tuple[list[dict], list[dict], bool, list[dict] | None]:
    """``(prompt, completion, desirable, tools)`` of one decoded record, or ``RecordProblem``."""
    if not isinstance(record, dict):
        raise RecordProblem(f"expected a JSON object per line, got {type(record).__name__}")
    if "chosen" in record or "rejected" in record:
        raise RecordProblem("a preference pair ('chosen'/'rejected'); kind = \"kto\" reads unpaired records "
                            "{'prompt', 'completion', 'label'} (a pair is two of them: chosen true, rejected false)")
    if "label" not in record:
        raise RecordProblem("missing 'label' (true for a desirable completion, false for an undesirable one)")
    label = record["label"]
    if not isinstance(label, bool):
        raise RecordProblem(f"'label' must be true or false, got {json.dumps(label)[:40]}")
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise RecordProblem("give either 'messages' or 'prompt' and 'completion', not both")
        messages = messages_of(record["messages"], "messages")
        cut = len(messages)
        while cut > 0 and messages[cut - 1]["role"] == "assistant":
            cut -= 1
        prompt, completion = messages[:cut], messages[cut:]
        if not completion:
            raise RecordProblem("'messages' does not end with an assistant message (the completion to score)")
        if not prompt:
            raise RecordProblem("'messages' has no prompt before its assistant messages")
    else:
        for key in ("prompt", "completion"):
            if key not in record:
                raise RecordProblem(f"missing '{key}' (a KTO record is 'prompt', 'completion' and 'label', "
                                    "or 'messages' and 'label')")
        prompt, completion = messages_of(record["prompt"], "prompt"), messages_of(record["completion"], "completion")
        if not prompt:
            raise RecordProblem("'prompt' is empty")
    if arm_is_empty(completion):
        raise RecordProblem("the completion is empty (no assistant reply to score)")
    if completion[0]["role"] != "assistant":
        raise RecordProblem(f"'completion' must start with an assistant message, got {completion[0]['role']}")
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RecordProblem("'tools' must be a list of objects")
    return prompt, completion, label, (tools or None)


def kto_record(record: Any, origin: str) -> KTORecord:
    """Validate one decoded record; ``DataError('origin: problem')`` when it is bad."""
    try:
        prompt, completion, desirable, tools = parse_kto(record)
    except RecordProblem as err:
        raise DataError(f"{origin}: {err}") from None
    return KTORecord(prompt, completion, desirable, tools, origin)


def _encode(record: KTORecord, tokenizer, config: DataConfig) -> Document:
    """The record's own document; ``DataError`` for a completion that trains nothing or a record
    that leaves no room in its row for its KL sample (its prompt again and a completion token)."""
    try:
        ids, mask = encode_arm(tokenizer, record.prompt, record.completion, record.tools, config)
    except DataError as err:
        raise DataError(f"{record.origin}: 'completion': {err}") from None
    doc = Document(tuple(ids), tuple(mask), record.origin)
    if doc.num_trained == 0:
        raise DataError(f"{record.origin}: the completion is empty after the chat template (no trained token)")
    first = mask.index(True)  # the tokens before the completion's first scored token: the prompt
    if len(doc) + first + 1 > config.max_seq_len:
        raise DataError(f"{record.origin}: the record is {len(doc)} tokens; with its KL sample (its {first}-token "
                        f"prompt again and a completion) it needs {len(doc) + first + 1} > data.max_seq_len = "
                        f"{config.max_seq_len}")
    return doc


def _kl_document(record: KTORecord, other: KTORecord, room: int, tokenizer, config: DataConfig) -> Document:
    """``record``'s prompt with ``other``'s completion, cut to ``room`` tokens."""
    try:
        ids, mask = encode_arm(tokenizer, record.prompt, other.completion, record.tools, config)
    except DataError as err:
        raise DataError(f"{record.origin}: its KL sample (the completion of {other.origin}): {err}") from None
    doc = Document(tuple(ids[:room]), tuple(mask[:room]), record.origin)
    if doc.num_trained == 0:
        raise DataError(f"{record.origin}: its KL sample (this prompt with the completion of {other.origin}) keeps "
                        f"no scored token within the row's {room} free tokens (data.max_seq_len = "
                        f"{config.max_seq_len})")
    return doc


def partners(n: int, seed: int) -> list[int]:
    """σ: record ``i`` takes the completion of record ``σ[i]`` for its KL sample; a cycle through
    a shuffle of ``range(n)`` seeded by ``seed`` (σ[i] ≠ i for n ≥ 2)."""
    order = list(range(n))
    random.Random(f"{seed}:kto-kl").shuffle(order)
    sigma = [0] * n
    for k, i in enumerate(order):
        sigma[i] = order[(k + 1) % n]
    return sigma


def read_kto_records(paths: Sequence[str], tokenizer, config: DataConfig, stats: DataStats | None = None,
                     skipped: list[str] | None = None, max_records: int | None = None) -> list[Pair]:
    """Every good KTO record of ``paths`` as a :class:`Pair` (module docstring), in file order,
    indexed 0, 1, ... in that order; ``read_pairs``' signature and bad-record policy.

    A bad record raises its ``DataError`` (``data.on_bad_record = "error"``) or is left out,
    counted in ``stats.bad_records`` and its message appended to ``skipped`` (``"skip"``).
    Fewer than two good records is a ``DataError`` (the KL sample needs another record)."""
    stats = stats if stats is not None else DataStats()
    records: list[tuple[KTORecord, Document]] = []

    def bad(err: DataError) -> None:
        if config.on_bad_record != "skip":
            raise err
        stats.bad_records += 1
        if skipped is not None:
            skipped.append(str(err))

    for path in paths:
        reader = open_reader(path)  # any source an SFT run reads (JSONL, JSON, Parquet, Arrow, datasets)
        for count, (_, label, raw) in enumerate(reader.scan(), start=1):
            if max_records is not None and count > max_records:
                break
            origin = reader.origin(label)
            try:
                record = kto_record(reader.record(raw, origin), origin)
                records.append((record, _encode(record, tokenizer, config)))
            except DataError as err:
                bad(err)
        reader.close()
    if len(records) < 2:
        where = paths[0] if len(paths) == 1 else f"{len(paths)} files ({paths[0]}, ...)"
        raise DataError(f"{where}: {len(records)} usable KTO record(s); kind = \"kto\" needs at least 2 (each "
                        "record's KL sample is another record's completion)")
    sigma = partners(len(records), config.seed)
    out: list[Pair] = []
    for i, (record, doc) in enumerate(records):
        try:
            kl = _kl_document(record, records[sigma[i]][0], config.max_seq_len - len(doc), tokenizer, config)
        except DataError as err:
            bad(err)
            continue
        stats.records += 1
        stats.samples += 1
        stats.tokens += len(doc) + len(kl)
        stats.trained_tokens += doc.num_trained + kl.num_trained
        out.append(Pair(doc, kl, len(out), desirable=record.desirable))
    return out


def label_counts(pairs: Sequence[Pair]) -> tuple[int, int]:
    """``(desirable, undesirable)`` records."""
    good = sum(bool(p.desirable) for p in pairs)
    return good, len(pairs) - good


__all__ = ["KTORecord", "kto_record", "label_counts", "parse_kto", "partners", "read_kto_records"]
