"""Sampling completions: pgs's ``generate`` beside transformers' ``generate``, same model, same call.

On-policy distillation spends most of its step sampling the student (docs/performance.md, the
distill suite), so the decode loop is measured here on its own.  One random-init model of the
distill recipe's student shape (Qwen3-0.6B, bf16, on the device), ``--prompts`` prompts of
``--prompt-tokens`` random token ids each (lengths spread over the last 10%, so that rows are
left-padded as in a real batch), ``--new-tokens`` sampled tokens per prompt at temperature 1
(no stop ids for pgs, ``min_new_tokens`` for transformers: every row decodes the full length).

Setups (in this order, one process; ``--only``):

1. ``pgs``: ``pgs.runtime.model.generate.generate`` as the distillation loop calls it: static KV
   cache, compiled decode step captured as a CUDA graph per batch, the stop check every few tokens.
2. ``pgs_eager``: the same function with ``compile=False`` (static cache, eager decode steps).
3. ``hf_static``: ``model.generate(cache_implementation="static")``; transformers compiles its
   forward for a static cache by itself (its ``CompileConfig``: ``reduce-overhead``).
4. ``hf``: ``model.generate`` with its defaults (dynamic cache, eager): what TRL's trainers call.

The model is built as pgs builds a recipe's (``attn_implementation = "auto"``: pgs's attention
function on CUDA, whose decode step reads grouped key/value heads in place); the transformers
setups switch it to transformers' own SDPA for their calls.

Per setup: the median over ``--repeats`` timed calls after ``--warmup`` untimed ones (compilation;
pgs captures its graph anew in every call, inside the call's time) of the whole call's seconds; ``tok_s`` (sampled tokens over that time); the
prefill's seconds (a call with one new token) and ``decode_ms`` per token after it; and, for the
compiled setups, torch.compile's CUDA-graph counters (transformers' static setup; a skip reason there
means no graph; pgs captures its own graph, which these do not count).  The floor
is the bytes one decode step must read (every weight once, the KV cache of the step's width) over
the measured copy bandwidth (``--bandwidth``, default 4.1 TB/s: docs/performance.md).

    python -m bench generate
    python -m bench generate --prompts 64 --only pgs,hf_static
    python -m bench generate --small          # a tiny shape on the CPU (a smoke run of this script)
    python -m bench generate --only pgs --profile 25   # + the 25 kernels that took the most device time

``--widths L1,L2,...``: after the timed calls, one call per prompt length, each row's
``widths`` listing every call's seconds, tokens/s and dynamo's compiled graphs so far: prompts of
many lengths, as a real dataset's, against the compiled steps' shapes (a step compiled per width
runs uncompiled past dynamo's recompile limit of 8).

    python -m bench generate --only pgs,hf_static --widths 300,400,500,600,700,800,900,1000,1100,1200,400,1200

``--profile K``: after the timed calls, one more call of each setup under ``torch.profiler``; the
row gets ``kernels`` (the K kernels with the most device time: name, calls, total ms, share) and
``kernels_per_token`` (kernel launches over sampled tokens per row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pgs.runtime.model.build import build_model  # noqa: E402
from pgs.runtime.model.generate import GenerationSettings, generate, left_pad  # noqa: E402

STUDENT = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0)
SMALL = dict(STUDENT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)


def make_prompts(n: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo = max(1, tokens - tokens // 10)
    lengths = torch.randint(lo, tokens + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


def floor_ms(model, prompts, new_tokens: int, bandwidth: float) -> tuple[float, float]:
    """(bytes per decode step at the mean width, its time at ``bandwidth`` in ms)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    width = max(len(p) for p in prompts) + new_tokens / 2
    kv = len(prompts) * width * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    return weights + kv, (weights + kv) / bandwidth * 1e3


def _pgs(model, prompts, new_tokens, compile_step, seed):
    gen = torch.Generator(device=model.device).manual_seed(seed)
    out = generate(model, prompts, GenerationSettings(max_new_tokens=new_tokens, temperature=1.0), stop_ids=[],
                   pad_id=0, generator=gen, compile=compile_step)
    return out.generated_tokens


def _hf(model, prompts, new_tokens, static, seed):
    """transformers' generate with its own attention (SDPA), whatever the model was built with."""
    own = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return _hf_generate(model, prompts, new_tokens, static, seed)
    finally:
        model.set_attn_implementation(own)


def _hf_generate(model, prompts, new_tokens, static, seed):
    ids, mask = left_pad(prompts, 0, model.device)
    torch.manual_seed(seed)
    kw = dict(cache_implementation="static") if static else {}
    out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         pad_token_id=0, **kw)
    return (out.shape[1] - ids.shape[1]) * len(prompts)


#: each setup's call: (model, prompts, new tokens, seed) -> sampled tokens
CALLS = {
    "pgs": lambda model, prompts, n, seed: _pgs(model, prompts, n, None, seed),
    "pgs_eager": lambda model, prompts, n, seed: _pgs(model, prompts, n, False, seed),
    "hf_static": lambda model, prompts, n, seed: _hf(model, prompts, n, True, seed),
    "hf": lambda model, prompts, n, seed: _hf(model, prompts, n, False, seed),
}
SETUPS = tuple(CALLS)  # the order they run in


def timed(fn) -> tuple[float, int]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def cudagraph_counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def measure(name, model, prompts, args) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    def run(n):
        return CALLS[name](model, prompts, n, args.seed)

    for _ in range(args.warmup):
        run(args.new_tokens)
        run(1)
    full = [timed(lambda: run(args.new_tokens)) for _ in range(args.repeats)]
    prefill = [timed(lambda: run(1))[0] for _ in range(args.repeats)]
    seconds = statistics.median(s for s, _ in full)
    first = statistics.median(prefill)
    tokens = full[0][1]
    row = dict(setup=name, seconds=seconds, seconds_all=[round(s, 4) for s, _ in full], sampled_tokens=tokens,
               tok_s=tokens / seconds, prefill_s=first,
               decode_ms=(seconds - first) / max(1, args.new_tokens - 1) * 1e3, cudagraph=cudagraph_counters())
    if torch.cuda.is_available():
        row["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.widths:
        row["widths"] = width_calls(name, model, args)
    if args.profile:
        row.update(kernel_table(lambda: run(args.new_tokens), args.profile, args.new_tokens))
    return row


def width_calls(name, model, args) -> list[dict]:
    """One call per ``--widths`` prompt length (``--prompts`` prompts each, the same spread as the
    main prompts): its seconds and sampled tokens/s, and the compiled graphs dynamo has made by
    then.  A decode step compiled per width reaches dynamo's recompile limit (8) within these calls
    and runs every later new width uncompiled; those calls' tokens/s show it."""
    from torch._dynamo.utils import counters

    vocab = model.config.vocab_size
    rows = []
    for i, length in enumerate(args.widths):
        ps = make_prompts(args.prompts, length, vocab, args.seed + 1 + i)
        seconds, tokens = timed(lambda: CALLS[name](model, ps, args.new_tokens, args.seed))
        rows.append(dict(prompt_tokens=length, seconds=round(seconds, 4), tok_s=round(tokens / seconds, 1),
                         graphs=int(counters["stats"].get("unique_graphs", 0))))
    return rows


def kernel_table(fn, top: int, new_tokens: int) -> dict:
    """One call of ``fn`` under torch.profiler: its ``top`` kernels by device time and the launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    totals = []
    for avg in prof.key_averages():  # kernels (and copies) are the entries with device time of their own
        own = getattr(avg, "self_device_time_total", None)
        own = avg.self_cuda_time_total if own is None else own
        if own > 0:
            totals.append((avg.key, avg.count, own))
    whole = sum(t for _, _, t in totals) or 1.0
    launches = sum(c for _, c, _ in totals)
    ranked = sorted(totals, key=lambda x: -x[2])[:top]
    return {"kernels": [dict(name=n[:160], calls=c, total_ms=t / 1e3, share=t / whole) for n, c, t in ranked],
            "kernel_ms_total": whole / 1e3, "kernels_per_token": launches / max(1, new_tokens)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(SETUPS))
    p.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s for the floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="profile one more call: its K top kernels")
    p.add_argument("--widths", default="", metavar="L1,L2,...",
                   help="after the timed calls, one call per prompt length (each row's 'widths')")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.widths.split(",") if w]
    except ValueError:
        p.error(f"--widths: {args.widths!r} is not a comma list of prompt lengths")
    if any(w < 1 for w in args.widths):
        p.error("--widths: prompt lengths are at least 1")
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SETUPS))
    if unknown:
        p.error(f"--only: unknown setups {unknown}; known: {', '.join(SETUPS)}")
    if args.small:
        config, device = SMALL, "cpu"
        args.prompts, args.prompt_tokens, args.new_tokens, args.warmup, args.repeats = 3, 12, 6, 1, 1
    else:
        config, device = STUDENT, "cuda"
    model = build_model(config=config, dtype="bfloat16", init_seed=0, device=device).eval()
    prompts = make_prompts(args.prompts, args.prompt_tokens, config["vocab_size"], args.seed)
    step_bytes, floor = floor_ms(model, prompts, args.new_tokens, args.bandwidth)
    result = dict(config=config, prompts=args.prompts, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                  versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__),
                  device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  decode_step_bytes=step_bytes, decode_floor_ms=floor, results=[])
    for name in only:
        try:
            row = measure(name, model, prompts, args)
        except Exception as err:  # one setup's failure is reported, the others still run
            row = dict(setup=name, error=f"{type(err).__name__}: {err}"[:2000])
        if "decode_ms" in row:
            row["floor_fraction"] = floor / row["decode_ms"]
        result["results"].append(row)
        print(json.dumps(row), flush=True)
        base = {r["setup"]: r for r in result["results"] if "tok_s" in r}
        if "pgs" in base:
            result["pgs_over"] = {k: base["pgs"]["tok_s"] / r["tok_s"] for k, r in base.items() if k != "pgs"}
        if args.out:  # after every setup: a call cut short keeps what it measured
            with open(args.out, "w") as handle:
                json.dump(result, handle, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
