"""CPU probe (session 7): is the frequency plateau that Lion keeps on the Qwen3-0.6B shape
(pgs lion8bit and bitsandbytes' Lion8bit alike, bench/results/s7_call4, s7_call5) Lion's own,
and what removes it?

A 2-layer, 64-wide Qwen3 with Qwen3's vocabulary (151,936, tied embeddings unless ``--untie``)
trained for ``--steps`` steps of ``--batch``×128 tokens (default 4) from ``bench/sft_converge.py``'s 256-state chain
(``--data bytes``: windows of the stdlib's sources, one token per byte; ``--data bpe``: the
same text through a byte-level BPE trained on it) with Lion written out in
plain fp32 torch (no pgs, no 8-bit state): ``c = β1·m + (1-β1)·g; θ -= lr·sign(c);
m = β2·m + (1-β2)·g`` (arXiv 2302.06675), warm-up 10 + cosine.  ``--emb adamw`` steps the tied
embedding with AdamW (lr 3× Lion's) instead; ``--all-adamw`` steps everything with AdamW; ``--freeze-unused`` zeroes the tied
embedding's gradient on the rows of ids the data never uses (sign(0) = 0: Lion leaves them).
Prints the mean of the last 10 losses and every 15th loss.  About 3 minutes on two CPU cores.

    python bench/experiments/lion_plateau.py [--untie] [--vocab 512] [--data bytes|bpe] [--all-adamw]
    python bench/experiments/lion_plateau.py --data bpe --vocab 8192 --bpe-vocab 8192 --batch 32   # session 8
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sft_converge as C
from sft_step import build
ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float, default=1e-3); ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--b1", type=float, default=0.9); ap.add_argument("--b2", type=float, default=0.99)
ap.add_argument("--vocab", type=int, default=151936); ap.add_argument("--untie", action="store_true")
ap.add_argument("--emb", choices=("lion", "adamw", "lion_lr0.1"), default="lion")
ap.add_argument("--data", default="markov"); ap.add_argument("--all-adamw", action="store_true")
ap.add_argument("--freeze-unused", action="store_true",
                help="zero the tied embedding's gradient on the rows of ids the data never uses")
ap.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per step (default 4)")
ap.add_argument("--bpe-vocab", type=int, default=0,
                help="--data bpe: the tokenizer's vocabulary (default: the model's); with --vocab equal to it "
                     "every id is in use")
ap.add_argument("--adam-lr-mult", type=float, default=3.0, help="AdamW's lr as a multiple of --lr (default 3)")
a = ap.parse_args()
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
table = dict(model_type="qwen3", hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=a.vocab, tie_word_embeddings=not a.untie,
             max_position_embeddings=4096)
g = torch.Generator().manual_seed(1)
if a.data == "bpe":  # the same text through a BPE trained on it: ~48k ids used, a Zipf-like spread
    corpus, _ = C.bpe_corpus(vocab=a.bpe_vocab or a.vocab)
    ids = torch.arange(a.vocab)
    data = [C.sample_bytes(corpus, ids, a.batch, 128, 0, corpus.numel(), g) for _ in range(a.steps)]
elif a.data == "bytes":
    corpus, _ = C.byte_corpus(8 << 20)
    ids = torch.randperm(a.vocab, generator=torch.Generator().manual_seed(0))[:256]
    data = [C.sample_bytes(corpus, ids, a.batch, 128, 0, corpus.numel(), g) for _ in range(a.steps)]
else:
    ids, succ = C.markov_source(a.vocab, 256, 0)
    data = [C.sample(ids, succ, a.batch, 128, g) for _ in range(a.steps)]
model = build(table, torch.device("cpu")).float()
params = [p for p in model.parameters() if p.requires_grad]
mom = [torch.zeros_like(p) for p in params]
emb = model.get_input_embeddings().weight
v2 = {id(emb): torch.zeros_like(emb)}
L = []
for t, x in enumerate(data):
    lr = C.lr_at(t, a.lr, 10, a.steps)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if a.freeze_unused:
        keep = torch.zeros(a.vocab, 1)
        keep[ids] = 1
        emb.grad.mul_(keep)
    with torch.no_grad():
        for p, m in zip(params, mom):
            if (p is emb and a.emb == "adamw") or a.all_adamw:  # AdamW (β 0.9/0.95, lr 3× Lion's) for the tied embedding
                v = v2.setdefault(id(p), torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                mh = m / (1 - 0.9 ** (t + 1))
                vh = v / (1 - 0.95 ** (t + 1))
                p.addcdiv_(mh, vh.sqrt().add_(1e-8), value=-a.adam_lr_mult * lr)
                p.grad = None
                continue
            if p is emb and a.emb == "lion_lr0.1":
                lr_p = 0.1 * lr
            else:
                lr_p = lr
            c = a.b1 * m + (1 - a.b1) * p.grad
            p.add_(c.sign(), alpha=-lr_p)
            m.mul_(a.b2).add_(p.grad, alpha=1 - a.b2)
            p.grad = None
    L.append(float(loss.detach()))
print("fp32 lion" if not a.all_adamw else "fp32 adamw", vars(a), round(sum(L[-10:]) / 10, 3), [round(v, 2) for v in L[::15]], flush=True)
