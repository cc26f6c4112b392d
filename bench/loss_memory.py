"""Peak memory and time of one loss forward + backward, per backend (not a test).

    python -m bench loss-memory             # CUDA: 8×4096 tokens, V=151,936, D=1024, bf16
    python -m bench loss-memory --small     # tiny CPU smoke run
    python bench/loss_memory.py OUT.json    # the script alone (its JSON path comes first)

Backends: ``hf_dense`` (full logits, fp32 upcast, F.cross_entropy, as HF models do),
``pgs_dense``, ``chunked`` (pgs), ``liger`` and ``cce`` (when installed, CUDA only).
Peak memory is what the loss adds on top of the inputs (h, W and their gradients are
allocated before the measurement starts); on CPU it is not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from pgs.errors import PgsError
from pgs.func.losses import token_loss


def hf_dense(h, W, labels, **_):
    logits = (h @ W.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def make_runner(name, chunk_size):
    if name == "hf_dense":
        return hf_dense
    backend = {"pgs_dense": "dense"}.get(name, name)

    def run(h, W, labels):
        return token_loss(h, W, labels, backend=backend, chunk_size=chunk_size, stats=False).loss_sum

    return run


def measure(fn, h, W, labels, repeats, device):
    times, peak = [], None
    for i in range(repeats + 1):
        h.grad = W.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = fn(h, W, labels)
        (loss / (labels != -100).sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        if i:  # the first run warms up kernels and the allocator
            times.append(time.perf_counter() - start)
        del loss
    return {"peak_gib": peak, "median_ms": 1e3 * statistics.median(times)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the JSON file to write")
    parser.add_argument("--small", action="store_true", help="tiny sizes, CPU allowed (smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--backends", default="hf_dense,pgs_dense,chunked,liger,cce")
    args = parser.parse_args(argv)

    if args.small:
        tokens, vocab, hidden, dtype = 2 * 256, 4096, 64, torch.float32
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        chunk = min(args.chunk_size, 128)
    else:
        if not torch.cuda.is_available():
            print("the full benchmark needs CUDA; use --small for a CPU smoke run", file=sys.stderr)
            return 2
        tokens, vocab, hidden, dtype = 8 * 4096, 151_936, 1024, torch.bfloat16
        device, chunk = torch.device("cuda"), args.chunk_size

    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    W = (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    labels[: tokens // 4] = -100  # a prompt share, masked

    rows = []
    for name in args.backends.split(","):
        fn = make_runner(name, chunk)
        try:
            with torch.no_grad():
                loss = float(fn(h.detach(), W.detach(), labels))
            row = measure(fn, h, W, labels, args.repeats, device)
            row["loss"] = loss
        except (PgsError, RuntimeError) as err:
            row = {"peak_gib": None, "median_ms": None, "loss": None, "skipped": str(err).splitlines()[0]}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["backend"] = name
        rows.append(row)

    header = f"{'backend':<10} {'peak GiB':>9} {'ms':>9} {'loss sum':>14}"
    print(f"tokens={tokens} V={vocab} D={hidden} dtype={dtype} device={device} chunk={chunk}")
    print(header)
    for r in rows:
        if "skipped" in r:
            print(f"{r['backend']:<10} skipped: {r['skipped']}")
            continue
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
        print(f"{r['backend']:<10} {peak:>9} {r['median_ms']:>9.2f} {r['loss']:>14.4f}")
    meta = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": str(dtype),
            "device": str(device), "chunk_size": chunk, "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump({"config": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
