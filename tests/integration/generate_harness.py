"""The rank side of tests/integration/test_services_distributed.py's generation test.

Not a test module: the test starts it once per rank (``python generate_harness.py OUT``) with
the environment torchrun would give.  Each rank builds the tiny model twice from the same
seed (``initializer_range = 1``: a random model whose greedy replies differ from prompt to
prompt): one copy whole (the one-process reference), one sharded with FSDP2 over all ranks
(gloo).  It writes ``OUT/result_rank<r>.json``:

- ``accuracy`` / ``reference``: ``task_accuracy`` of the quickstart's first eval records on the
  sharded model (``ranks=``: each rank its share of the batches) and on the whole one (rank 0);
- ``seen`` / ``seen_reference``: every reply the checker was shown, with its record and turn
  (this rank's share, and on rank 0 all of them on the whole model);
- ``synced`` / ``synced_reference``: ``generate(synced=True)`` of this rank's own prompts with
  stop ids that end the rows at different steps on different ranks, and the same prompts on
  the whole model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pgs.runtime.data import synthetic
from pgs.runtime.data.packing import pad_id
from pgs.runtime.dist import fsdp as D
from pgs.runtime.loop.evaluate import read_samples, task_accuracy
from pgs.runtime.model.build import build_model
from pgs.runtime.model.generate import GenerationSettings, generate
from pgs.runtime.model.loading import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import QUICKSTART  # noqa: E402
from tiny import tiny_table  # noqa: E402

SAMPLES, BATCH, NEW_TOKENS = 10, 3, 6


def model(tokenizer):
    config = tiny_table(initializer_range=1.0)
    return build_model(path=None, config=config, dtype="float32", attn_implementation="sdpa", init_seed=3,
                       vocab_size=len(tokenizer), device=torch.device("cpu"))


def accuracy(m, tokenizer, samples, ranks=None):
    """``task_accuracy`` with a checker that accepts a reply by the parity of its length and
    records what it was shown: the verdicts depend on every generated token."""
    seen = []
    index = {id(s): i for i, s in enumerate(samples)}

    def turns(sample):
        return [(messages, tools, {"record": index[id(sample)], "turn": k, **expected})
                for k, (messages, tools, expected) in enumerate(synthetic.eval_turns(sample))]

    def matches(expected, text):
        seen.append([expected["record"], expected["turn"], text])
        return len(text) % 2 == 0

    out = task_accuracy(m, tokenizer, samples, turns=turns, matches=matches, max_new_tokens=NEW_TOKENS,
                        batch_size=BATCH, ranks=ranks)
    return out, seen


def main(out: Path) -> None:
    ctx = D.init(device="cpu")
    tokenizer = load_tokenizer(str(QUICKSTART / "tokenizer"))
    samples = read_samples(str(QUICKSTART / "eval.jsonl"), SAMPLES)
    whole = model(tokenizer)
    sharded = D.shard_model(model(tokenizer), ctx.mesh)
    reference, seen_reference = accuracy(whole, tokenizer, samples) if ctx.rank == 0 else (None, None)
    got, seen = accuracy(sharded, tokenizer, samples, ranks=(ctx.rank, ctx.world_size))

    # generate(synced=True): rank r generates prompts r, r + world, ...; the stop ids are tokens the
    # whole model emits at different steps, so the ranks' batches stop at different steps
    texts = [tokenizer.apply_chat_template(s["messages"][:1], tools=s.get("tools"), tokenize=False,
                                           add_generation_prompt=True) for s in samples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, temperature=0)
    free = generate(whole, ids, settings, stop_ids=[], pad_id=pad_id(tokenizer)).completions()
    stops = sorted({free[0][1], free[1][3]})
    mine = ids[ctx.rank::ctx.world_size]
    synced = generate(sharded, mine, settings, stop_ids=stops, pad_id=pad_id(tokenizer), synced=True)
    alone = generate(whole, mine, settings, stop_ids=stops, pad_id=pad_id(tokenizer))
    result = {"accuracy": got, "reference": reference, "seen": seen, "seen_reference": seen_reference,
              "synced": synced.completions(), "synced_reference": alone.completions(),
              "stop_lengths": [len(c) for c in alone.completions()]}
    (out / f"result_rank{ctx.rank}.json").write_text(json.dumps(result))
    D.barrier()
    D.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
