"""A short convergence check: pgs's memory-lean recipe against an HF + AdamW baseline.

Run on one GPU (written for an H200; not a test; ~2-3 minutes at the defaults):

    python -m bench sft-converge
    python -m bench sft-converge --small --steps 6      # CPU smoke

Every variant trains the same random init (Qwen3-0.6B shape, from its config) for the same
steps on the same batches and with the same warm-up + cosine learning-rate shape; the
batches come from a fixed synthetic but learnable source: a first-order Markov chain over
``--states`` token ids, each with 4 successors of probabilities 0.4/0.3/0.2/0.1, so the
best achievable loss is the chain's entropy (1.280 nats) and a model that learns nothing
stays near ln(states).

- ``hf_adamw``: fp32 weights (the master copy), bf16 autocast, transformers' own loss,
  ``torch.optim.AdamW`` (fused on CUDA): what a TRL user gets with ``bf16=True``.
- ``pgs_lion8bit``: bf16 weights without a master copy, ``pf.lion8bit`` run inside backward
  (``GradientRelease``, the fused in-place kernel, stochastic rounding into bf16), the
  chunked loss with the tied head's gradient deferred into the embedding's.
- ``hf_lion8bit_bnb``: ``hf_adamw`` with bitsandbytes' ``Lion8bit`` at ``--lion-lr`` (is a
  Lion result Lion's or pgs's?).
- ``pgs_adamw8bit``: the same with ``pf.adamw8bit`` at AdamW's learning rate (separates the
  optimizer's effect from the precision's); with ``--master``, the pgs variants keep an fp32
  master copy (``master_weights="fp32"``) instead of rounding stochastically into bf16.

Data (``--data``): the chain above (``markov``, the default); ``bytes``: windows of this
Python's standard-library sources, one token per byte; ``bpe``: the same text through a
byte-level BPE trained on it (tens of thousands of ids used, the rest of the vocabulary unseen,
as SFT text through a real tokenizer).  ``--warm-start N`` makes it a fine-tuning comparison:
the random init is first trained N steps by ``hf_adamw`` on other data (the first 45% of the
text, or another chain) and every variant starts from those weights.

Reported per variant: the loss of every step, the mean of the last 10, the held-out loss on
fixed batches of the same chain, tok/s, peak allocated memory; an error string instead when a
variant fails.  JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import traceback

if "--triton-on-cpu" in sys.argv:  # before triton is imported: its interpreter, then pgs's CPU switch
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

if "--triton-on-cpu" in sys.argv:
    from pgs.func.kernels import configure

    configure(triton_on_cpu=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sft_step import SHAPES, SMALL_SHAPES, build  # noqa: E402

VARIANTS = ("hf_adamw", "pgs_lion8bit", "pgs_adamw8bit", "hf_lion8bit_bnb")
PROBS = (0.4, 0.3, 0.2, 0.1)


def markov_source(vocab: int, states: int, seed: int):
    """(token ids of the states, successor table [states, 4]) of a fixed random chain."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:states]
    succ = torch.randint(0, states, (states, len(PROBS)), generator=g)
    return ids, succ


def sample(ids, succ, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    probs = torch.tensor(PROBS)
    s = torch.randint(0, succ.shape[0], (batch,), generator=g)
    out = torch.empty(batch, seq, dtype=torch.long)
    for t in range(seq):
        out[:, t] = s
        pick = torch.multinomial(probs.expand(batch, -1), 1, generator=g).squeeze(1)
        s = succ[s, pick]
    return ids[out]


def byte_corpus(max_bytes: int = 64 << 20) -> tuple[torch.Tensor, dict]:
    """The bytes of this Python's standard-library sources (``*.py`` under the stdlib folder,
    sorted paths, up to ``max_bytes``) as a uint8 tensor, and what they are (text that is on
    every machine, with no network: learning on it is gradual, from byte frequencies to
    words and syntax, where the Markov chain's is one sharp step)."""
    import glob
    import hashlib
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    chunks, size = [], 0
    for path in paths:
        with open(path, "rb") as f:
            b = f.read()
        chunks.append(b)
        size += len(b)
        if size >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    info = {"corpus": f"python {platform.python_version()} stdlib *.py", "files": len(chunks), "bytes": len(blob),
            "sha256_16": hashlib.sha256(blob).hexdigest()[:16]}
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), info


def bpe_corpus(max_bytes: int = 16 << 20, vocab: int = 151_936) -> tuple[torch.Tensor, dict]:
    """``byte_corpus``'s text tokenized by a byte-level BPE trained on it (``tokenizers``, merges
    of pairs seen at least twice, at most ``vocab`` tokens; ~5 s on two CPU cores): token ids as a
    long tensor and what they are.  Like SFT text through a real tokenizer, the data uses tens of
    thousands of ids with a Zipf-like spread and leaves the rest of a large vocabulary unseen
    (Python 3.11's stdlib, 16 MiB: ~54k tokens learned, ~48k ids used, unigram entropy 6.8 nats;
    3.12's on the H200 machine, 10.7 MB: 40,387 tokens, 35,435 ids used, 6.73 nats)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus, info = byte_corpus(max_bytes)
    lines = bytes(corpus.numpy()).decode("utf-8", errors="replace").split("\n")
    docs = ["\n".join(lines[i:i + 200]) for i in range(0, len(lines), 200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = torch.tensor([i for e in tok.encode_batch(docs) for i in e.ids], dtype=torch.long)
    counts = torch.bincount(ids).double()
    p = counts[counts > 0] / counts.sum()
    info.update(tokenizer_vocab=tok.get_vocab_size(), tokens=ids.numel(), ids_used=int((counts > 0).sum()),
                unigram_entropy=float(-(p * p.log()).sum()))
    return ids, info


def sample_bytes(corpus: torch.Tensor, ids: torch.Tensor, batch: int, seq: int, lo: int, hi: int,
                 g: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``seq`` bytes starting in ``[lo, hi - seq)``, each byte mapped to its
    token id (``ids[byte]``)."""
    starts = torch.randint(lo, hi - seq, (batch,), generator=g)
    windows = torch.stack([corpus[s:s + seq] for s in starts.tolist()]).long()
    return ids[windows]


def entropy_floor() -> float:
    return -sum(p * math.log(p) for p in PROBS)


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """The warm-up + cosine shape of ``pf.cosine_schedule`` (final 0), for torch's optimizer."""
    if step < warmup:
        return peak * step / max(warmup, 1)
    frac = min(1.0, (step - warmup) / max(total - warmup, 1))
    return peak * 0.5 * (1 + math.cos(math.pi * frac))


def setup(name: str, table: dict, device, args, init: dict | None = None):
    """(model, step(ids) -> loss float tensor, eval(ids) -> loss sum, valid).  ``init``: a state
    dict (the warm start's fp32 weights) loaded over the random init, after HF's upcast to fp32
    and into pgs's bf16 weights (rounded to nearest)."""
    import pgs.func as pf
    from pgs.func.losses import token_loss
    from pgs.runtime.model.build import final_hidden, output_head
    from pgs.runtime.optim.release import GradientRelease

    model = build(table, device)
    if name.startswith("hf_"):
        model.float()
    if init is not None:
        model.load_state_dict(init)
    pos_of = lambda ids: torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # noqa: E731

    def labels_of(ids):
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        return labels

    if name.startswith("hf_"):
        if name == "hf_adamw":
            peak = args.adam_lr
            opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.0,
                                    fused=device.type == "cuda")
        else:  # bitsandbytes' Lion8bit on the fp32 master: is a Lion plateau Lion's or pgs's?
            import bitsandbytes as bnb

            peak = args.lion_lr
            opt = bnb.optim.Lion8bit(model.parameters(), lr=peak, betas=(args.lion_b1, args.lion_b2),
                                     weight_decay=args.lion_wd)
        amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        count = [0]

        def step(ids):
            for group in opt.param_groups:
                group["lr"] = lr_at(count[0], peak, args.warmup, args.steps)
            with amp:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            count[0] += 1
            return loss.detach()
    else:
        backend = "triton" if args.triton_on_cpu else "auto"
        if name == "pgs_lion8bit":
            lr = pf.cosine_schedule(args.lion_lr, args.warmup, args.steps)
            chain = pf.lion8bit(lr, b1=args.lion_b1, b2=args.lion_b2, weight_decay=args.lion_wd, backend=backend)
        else:
            lr = pf.cosine_schedule(args.adam_lr, args.warmup, args.steps)
            chain = pf.adamw8bit(lr, b1=0.9, b2=0.95, weight_decay=0.0, backend=backend)
        if args.master:  # an fp32 master copy of every parameter instead of stochastic rounding into bf16
            release = GradientRelease(chain, model, master_weights="fp32", track_grad_norm=False)
        else:
            release = GradientRelease(chain, model, memory=pf.MemoryOptions(stochastic_rounding=True), track_grad_norm=False)
        defer = output_head(model)[0] is model.get_input_embeddings().weight

        def step(ids):
            h = final_hidden(model, ids, pos_of(ids))
            W, bias, softcap = output_head(model)
            r = token_loss(h, W, labels_of(ids), bias=bias, softcap=softcap, chunk_size=2048, memory=pf.MemoryOptions(defer_head_grad=defer))
            if defer:
                release.before_step(W, r.head_grad.add_to)
            loss = r.loss_sum / r.num_valid
            loss.backward()
            return loss.detach()

    @torch.no_grad()
    def evaluate(ids):
        model.eval()
        W, bias, softcap = output_head(model)
        h = final_hidden(model, ids, pos_of(ids))
        r = token_loss(h.to(W.dtype), W, labels_of(ids), bias=bias, softcap=softcap, chunk_size=2048)
        model.train()
        return float(r.loss_sum), int(r.num_valid)

    return model, step, evaluate


def warm_start(table: dict, data: list, device, args) -> tuple[dict, list]:
    """Train the random init with ``hf_adamw`` (fp32, AdamW at ``--adam-lr``, its own warm-up +
    cosine over ``len(data)`` steps) on ``data``; return its weights (fp32, on the CPU) and losses:
    the shared start of a fine-tuning comparison."""
    warm_args = argparse.Namespace(**{**vars(args), "steps": len(data)})
    model, step, _ = setup("hf_adamw", table, device, warm_args)
    losses = [float(x) for x in [step(ids.to(device)) for ids in data]]
    state = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in model.state_dict().items()}
    del model, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return state, losses


def run_variant(name: str, table: dict, data: list, held_out: list, device, args, init: dict | None = None) -> dict:
    out: dict = {"variant": name}
    model = step = None
    cuda = device.type == "cuda"
    try:
        model, step, evaluate = setup(name, table, device, args, init)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses = []
        t0 = time.perf_counter()
        for ids in data:
            losses.append(step(ids.to(device)))
        losses = [float(x) for x in losses]  # one sync at the end
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        out["losses"] = losses
        out["last10_mean"] = sum(losses[-10:]) / len(losses[-10:])
        s = n = 0
        for ids in held_out:
            a, b = evaluate(ids.to(device))
            s, n = s + a, n + b
        out["held_out_loss"] = s / max(n, 1)
        out["tok_s"] = sum(x.numel() for x in data) / elapsed
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as err:
        out["error"] = f"OOM: {str(err).splitlines()[0]}"
    except Exception as err:  # noqa: BLE001 - a bench reports every failure and goes on
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc(limit=6)
    finally:
        del model, step
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/sft_converge.json")
    p.add_argument("--only", default="", help=f"comma-separated variants of {', '.join(VARIANTS)}")
    p.add_argument("--small", action="store_true", help="the tiny shape (a CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 80; 8 with --small)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; 2 with --small)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; 32 with --small)")
    p.add_argument("--states", type=int, default=None, help="Markov states (default 1024; 64 with --small)")
    p.add_argument("--data", choices=("markov", "bytes", "bpe"), default="markov",
                   help="markov: the chain over --states ids; bytes: windows of this Python's standard-library "
                        "sources, one token per byte; bpe: the same text through a byte-level BPE trained on it "
                        "(tens of thousands of ids used; the last 5%% held out for both)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 10; 2 with --small)")
    p.add_argument("--adam-lr", type=float, default=3e-4)
    p.add_argument("--lion-lr", type=float, default=5e-5)
    p.add_argument("--lion-b1", type=float, default=0.9, help="Lion's update interpolation β1 (default 0.9)")
    p.add_argument("--lion-b2", type=float, default=0.99, help="Lion's momentum β2 (default 0.99)")
    p.add_argument("--lion-wd", type=float, default=0.0,
                   help="Lion's decoupled weight decay λ (the update adds lr·λ·θ; default 0, as AdamW's here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                   help="fine-tuning, not training from scratch: first train the random init with hf_adamw for "
                        "STEPS steps on other data (bytes/bpe: the first 45%% of the text, the variants then the "
                        "next 50%%; markov: another chain of the same size), and start every variant from those "
                        "weights")
    p.add_argument("--untie", action="store_true",
                   help="the shape with an untied output head (tie_word_embeddings false): Lion's frequency "
                        "plateau on tied, large-vocabulary models (docs/performance.md)")
    p.add_argument("--master", action="store_true",
                   help="pgs variants: an fp32 master copy of the weights instead of bf16 + stochastic rounding "
                        "(HF's precision: separates the precision's effect from the path's)")
    p.add_argument("--triton-on-cpu", action="store_true", help="8-bit kernels in Triton's interpreter (CPU)")
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.small else 80)
    args.batch = args.batch or (2 if args.small else 8)
    args.seq = args.seq or (32 if args.small else 1024)
    args.states = args.states or (64 if args.small else 1024)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.small else 10)
    variants = [v for v in args.only.split(",") if v] or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = dict((SMALL_SHAPES["tiny"] if args.small else SHAPES["qwen3-0.6b"])[0])
    if args.untie:
        table["tie_word_embeddings"] = False
    g = torch.Generator().manual_seed(args.seed + 1)
    corpus_info = {}
    warm_data: list = []
    if args.data in ("bytes", "bpe"):
        if args.data == "bytes":
            corpus, corpus_info = byte_corpus()
            ids = torch.randperm(table["vocab_size"], generator=torch.Generator().manual_seed(args.seed))[:256]
        else:
            corpus, corpus_info = bpe_corpus(vocab=table["vocab_size"])
            ids = torch.arange(table["vocab_size"])  # the tokenizer's own ids: the model's first rows
        cut = int(corpus.numel() * 0.95)
        lo = int(corpus.numel() * 0.45) if args.warm_start else 0
        warm_data = [sample_bytes(corpus, ids, args.batch, args.seq, 0, lo, g) for _ in range(args.warm_start)]
        data = [sample_bytes(corpus, ids, args.batch, args.seq, lo, cut, g) for _ in range(args.steps)]
        held_out = [sample_bytes(corpus, ids, args.batch, args.seq, cut, corpus.numel(), g) for _ in range(2)]
    else:
        if args.warm_start:
            w_ids, w_succ = markov_source(table["vocab_size"], args.states, args.seed + 1000)
            warm_data = [sample(w_ids, w_succ, args.batch, args.seq, g) for _ in range(args.warm_start)]
        ids, succ = markov_source(table["vocab_size"], args.states, args.seed)
        data = [sample(ids, succ, args.batch, args.seq, g) for _ in range(args.steps)]
        held_out = [sample(ids, succ, args.batch, args.seq, g) for _ in range(2)]
    init, warm_losses = None, []
    if args.warm_start:
        init, warm_losses = warm_start(table, warm_data, device, args)
        print(f"warm start: {args.warm_start} hf_adamw steps, loss {warm_losses[0]:.3f} -> last10 "
              f"{sum(warm_losses[-10:]) / len(warm_losses[-10:]):.3f}", flush=True)
    results = []
    for name in variants:
        r = run_variant(name, table, data, held_out, device, args, init)
        results.append(r)
        summary = r.get("error") or (f"loss {r['losses'][0]:.3f} -> last10 {r['last10_mean']:.3f}, held-out "
                                     f"{r['held_out_loss']:.3f}, {r['tok_s']:.0f} tok/s, "
                                     f"peak {r.get('peak_gib', float('nan')):.2f} GiB")
        print(f"{name:<14} {summary}", flush=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "argv": sys.argv[1:], "steps": args.steps, "batch": args.batch,
            "seq": args.seq, "states": args.states, "warmup": args.warmup, "adam_lr": args.adam_lr,
            "lion_lr": args.lion_lr, "lion_betas": [args.lion_b1, args.lion_b2], "lion_wd": args.lion_wd,
            "untied": args.untie, "data": args.data, "warm_start": args.warm_start,
            "warm_start_losses": warm_losses, **corpus_info}
    if args.data == "markov":  # the bytes' floor is unknown: no floor line
        meta.update(entropy_floor=entropy_floor(), uniform_loss=math.log(args.states))
    elif args.data == "bytes":
        meta.update(uniform_loss=math.log(256), states=256)
    else:
        meta.update(uniform_loss=math.log(corpus_info["ids_used"]), states=corpus_info["ids_used"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
