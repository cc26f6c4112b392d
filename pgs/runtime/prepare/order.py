"""``pgs prepare --order tfp``: the samples in Threshold Filtering Packing order (a standalone utility).

TFP (arXiv 2408.09327, docs/techniques/tfp.md) orders samples along a greedy nearest-neighbour path
of their instruction embeddings, skipping near-duplicates of the last few, so that related
samples land in the same pack and each sees the ones before it.  **Caveat:** that
benefit needs packed documents to attend to each other, which pgs prevents (every document
of a pack is isolated, docs/data.md) and pgs's stream reshuffles the records anyway.  So the
order has no effect on ``pgs run``: this writes the ordered JSONL for a trainer that packs in
file order without isolation.

The embedding of a sample is the mean of the model's final hidden states over its instruction:
the tokens before its first trained token (the whole rendered prompt).
"""

from __future__ import annotations

import torch

from pgs.func.data_scores import tfp_order
from pgs.runtime.data.packing import collate
from pgs.runtime.data.sources import SourceIndex
from pgs.runtime.data.packing import pad_id
from pgs.runtime.prepare.score import pending_samples
from pgs.runtime.prepare.select import write_selection


@torch.no_grad()
def instruction_embeddings(model, tokenizer, spec, device, batch_size: int = 16) -> tuple[list[str], torch.Tensor]:
    """The ids of the samples training keeps and their instruction embeddings ``[N, D]`` (fp32, CPU)."""
    from pgs.runtime.model.build import final_hidden

    indexes = [SourceIndex(s, spec.data.on_bad_record) for s in spec.data.sources]
    pad = pad_id(tokenizer)
    ids, rows = [], []
    group = []

    def flush():
        batch = collate([[p.document] for p in group], pad)
        h = final_hidden(model, batch.input_ids.to(device), batch.position_ids.to(device)).float().cpu()
        for r, p in enumerate(group):
            mask = p.document.train_mask
            n = next((i for i, m in enumerate(mask) if m), len(mask)) or 1
            rows.append(h[r, :n].mean(0))
            ids.append(p.id)
        group.clear()

    for pending in pending_samples(spec, tokenizer, indexes, set()):
        if pending.document is not None:
            group.append(pending)
            if len(group) >= batch_size:
                flush()
    if group:
        flush()
    return ids, torch.stack(rows) if rows else torch.zeros(0, 1)


def write_tfp(spec, model, tokenizer, device, path: str, *, threshold: float = 0.0, window: int = 1,
              batch_size: int = 16) -> int:
    """Write the kept samples of ``spec``'s sources to ``path`` in TFP order; returns how many."""
    ids, embeddings = instruction_embeddings(model, tokenizer, spec, device, batch_size)
    order = tfp_order(embeddings, threshold=threshold, window=window)
    return write_selection(spec, [ids[i] for i in order], path, keep_order=True)
