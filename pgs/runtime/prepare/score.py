"""Score every sample of a spec's sources with the spec's model, resumably.

Each record of each ``data.sources`` file is rendered, masked and length-checked exactly as
training does (``encode_document`` with the spec's ``[data]`` options), one document per row,
and scored with teacher forcing on its trained targets:

* ``nll`` ("familiarity"): mean −log p(target) over the trained targets (low: familiar);
* ``entropy``: mean full-vocabulary next-token entropy over the same positions (nats);
* ``hes``: the sum of the top 0.5% of those entropies (arXiv 2605.22389, docs/techniques/hes.md),
  response tokens only: the trained targets;
* ``tokens`` (the document's length) and ``trained`` (trained targets).

A record training would not use (too long under ``truncation = "drop"``, no trained token
left, a template that refuses it under ``on_bad_record = "skip"``) gets a line with
``"kept": false`` and the reason, so nothing disappears silently.

``scores.jsonl`` is appended a batch at a time and flushed; a killed run resumes by reading it
back (a torn last line is cut off) and scoring only the samples it does not hold.
``scores.meta.json`` records what the scores depend on (model, tokenizer, data options, the
sources' sizes); resuming into a folder scored with anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

import attrs
import torch

from pgs.errors import DataError, SpecError
from pgs.func.data_scores import HES_RHO, hes
from pgs.func.losses import token_nll_entropy
from pgs.runtime.data.packing import Document, collate
from pgs.runtime.data.sources import SourceIndex
from pgs.runtime.data.stats import DataStats
from pgs.runtime.data.packing import pad_id
from pgs.runtime.data.stream import encode_document

SCORES = "scores.jsonl"
META = "scores.meta.json"
META_VERSION = 1


def device_for(name: str) -> torch.device:
    """``train.device`` as a device: ``auto`` is the GPU when one is present, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load_model(spec, device: torch.device):
    """The spec's model (weights or random init, as ``pgs run`` builds it) in eval mode, and its tokenizer."""
    from pgs.runtime.model.build import build_model
    from pgs.runtime.model.loading import load_tokenizer

    m = spec.model
    tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
    config = None
    if m.config is not None:
        config = {k: v for k, v in m.config.items() if not (k == "vocab_size" and not v)}
    model = build_model(path=m.path, config=config, dtype=m.dtype, attn_implementation=m.attn_implementation,
                        varlen_kernel=m.varlen_kernel, experts_implementation=m.experts_implementation,
                        init_seed=m.init_seed, vocab_size=len(tokenizer), device=device)
    model.eval()
    return model, tokenizer


def sample_id(source: int, index: int) -> str:
    """A sample's id: its source's position in ``data.sources`` and its valid-record index there."""
    return f"{source}:{index}"


def fingerprint(spec, sizes: list[int]) -> dict:
    """What the scores depend on; a resume into a folder with another fingerprint is refused."""
    m, d = spec.model, spec.data
    model = {"path": m.path, "config": m.config, "init_seed": m.init_seed if m.path is None else None,
             "tokenizer": m.tokenizer, "dtype": m.dtype}
    data = {"sources": [f"{s.path}|{s.format}|{n}" for s, n in zip(d.sources, sizes)],
            "max_seq_len": d.max_seq_len, "truncation": d.truncation, "on_bad_record": d.on_bad_record,
            "last_turn_only": d.last_turn_only, "supervise_empty_think": d.supervise_empty_think,
            "train_roles": list(getattr(d, "train_roles", ("assistant",)))}
    blob = json.dumps({"model": model, "data": data}, sort_keys=True, default=str)
    return {"version": META_VERSION, "hes_rho": HES_RHO, "model": model, "data": data,
            "digest": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def read_scores(path: str, repair: bool = False) -> list[dict]:
    """The score lines of ``path`` (none when it does not exist).

    A last line without its newline is what a kill mid-write leaves: it is ignored, and with
    ``repair`` cut off the file so that appending continues on a clean line.  A malformed
    line elsewhere is a ``DataError`` naming it.
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as handle:
        raw = handle.read()
    good_end = raw.rfind(b"\n") + 1
    if good_end < len(raw) and repair:
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    out = []
    for number, line in enumerate(raw[:good_end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataError(f"{path}:{number}: not a score line (malformed JSON); score into a fresh --out") from None
    return out


@attrs.define
class Pending:
    """One sample to score: its id, where it came from, and its document (None: training drops it)."""

    id: str
    source: int
    index: int
    origin: str
    document: Document | None
    reason: str | None = None
    truncated: bool = False


def _reason(before: DataStats, after: DataStats) -> str:
    for name in ("dropped_too_long", "dropped_no_trained", "bad_records"):
        if getattr(after, name) > getattr(before, name):
            return {"dropped_too_long": "too_long", "dropped_no_trained": "no_trained",
                    "bad_records": "bad_record"}[name]
    return "dropped"


def pending_samples(spec, tokenizer, indexes: list[SourceIndex], done: set[str]) -> Iterator[Pending]:
    """The samples not yet in ``done``, in source then file order, tokenized as training would."""
    config = spec.data
    for s, index in enumerate(indexes):
        for i in range(len(index)):
            sid = sample_id(s, i)
            if sid in done:
                continue
            conversation = index.read(i)
            stats = DataStats()
            before = attrs.evolve(stats)
            document = encode_document(conversation, tokenizer, config, stats)
            if document is None:
                yield Pending(sid, s, i, conversation.origin, None, _reason(before, stats))
            else:
                yield Pending(sid, s, i, conversation.origin, document, truncated=stats.truncated > 0)


@torch.no_grad()
def score_documents(model, documents: list[Document], pad_id: int, device: torch.device,
                    chunk_size: int = 1024) -> list[dict]:
    """Scores of each document (one per row, padded to the longest): nll, entropy, hes, counts."""
    from pgs.runtime.model.build import final_hidden, output_head

    batch = collate([[d] for d in documents], pad_id)
    h = final_hidden(model, batch.input_ids.to(device), batch.position_ids.to(device))
    weight, bias, softcap = output_head(model)
    labels = batch.labels.to(device)
    nll, entropy = token_nll_entropy(h, weight, labels, bias=bias, softcap=softcap, chunk_size=chunk_size)
    valid = labels != -100
    out = []
    for r, document in enumerate(documents):
        row = valid[r]
        n = int(row.sum())
        ent = entropy[r][row].double().cpu()
        out.append({
            "tokens": len(document),
            "trained": n,
            "nll": float(nll[r][row].double().sum()) / max(n, 1),
            "entropy": float(ent.sum()) / max(n, 1),
            "hes": hes(ent),
        })
    return out


def score(spec, out_dir: str, *, batch_size: int = 16, device: torch.device | None = None,
          model=None, tokenizer=None, log=print, stop_after: int | None = None) -> dict:
    """Score every sample of ``spec``'s sources into ``out_dir/scores.jsonl``; returns counts.

    Resumes where a previous call (killed or stopped) left off.  ``model``/``tokenizer``: use
    these instead of building the spec's (a caller that already holds them).  ``stop_after``:
    stop after that many batches (a test's kill).
    """
    if batch_size < 1:
        raise SpecError(f"--batch-size: expected an integer >= 1, got {batch_size}")
    os.makedirs(out_dir, exist_ok=True)
    device = device or device_for(spec.train.device)
    stats = DataStats()
    indexes = [SourceIndex(s, spec.data.on_bad_record, stats) for s in spec.data.sources]
    meta = fingerprint(spec, [len(i) for i in indexes])
    meta_path, scores_path = os.path.join(out_dir, META), os.path.join(out_dir, SCORES)
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as handle:
            saved = json.load(handle)
        if saved.get("digest") != meta["digest"]:
            changed = sorted(k for k in ("model", "data") if saved.get(k) != meta[k]) or ["version"]
            raise SpecError(f"{out_dir}: scored with a different {' and '.join(changed)} "
                            f"({meta_path}); score into a fresh --out")
    elif os.path.exists(scores_path):
        raise SpecError(f"{scores_path} exists without {META}; score into a fresh --out")
    else:
        with open(meta_path, "w", encoding="utf-8") as handle:
            json.dump(meta, handle, indent=1, default=str)
    done = {line["id"] for line in read_scores(scores_path, repair=True)}
    resumed = len(done)
    if model is None:
        model, tokenizer = load_model(spec, device)
    pad = pad_id(tokenizer)
    chunk = spec.loss.chunk_size
    written = batches = 0
    total = sum(len(i) for i in indexes)
    with open(scores_path, "a", encoding="utf-8") as out:
        group: list[Pending] = []

        def flush() -> None:
            nonlocal written
            docs = [p for p in group if p.document is not None]
            scores = iter(score_documents(model, [p.document for p in docs], pad, device, chunk)) if docs else iter(())
            for p in group:
                line = {"id": p.id, "source": p.source, "index": p.index, "origin": p.origin}
                if p.document is None:
                    line.update(kept=False, reason=p.reason)
                else:
                    line.update(kept=True, **next(scores))
                    if p.truncated:
                        line["truncated"] = True
                out.write(json.dumps(line) + "\n")
            out.flush()
            os.fsync(out.fileno())
            written += len(group)
            group.clear()

        for pending in pending_samples(spec, tokenizer, indexes, done):
            group.append(pending)
            if sum(p.document is not None for p in group) >= batch_size:
                flush()
                batches += 1
                if batches % 20 == 0:
                    log(f"scored {resumed + written}/{total}")
                if stop_after is not None and batches >= stop_after:
                    return {"scored": written, "resumed": resumed, "total": total, "complete": False}
        if group:
            flush()
    for index in indexes:
        index.close()
    return {"scored": written, "resumed": resumed, "total": total, "complete": True,
            "bad_records": stats.bad_records}
