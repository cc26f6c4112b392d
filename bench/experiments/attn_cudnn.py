"""Probe (one H200): cuDNN's variable-length attention against FlashAttention-2's, for the
packed shapes pgs trains.  Prints one JSON line per check; run with ``python3
bench/experiments/attn_cudnn.py OUT.json``.

Checks: (1) ``aten._cudnn_attention_forward``/``_backward`` with ``cum_seq`` (THD layout,
grouped-query heads) run and equal ``torch.nn.attention.varlen.varlen_attn`` (flash) in
output and in dq/dk/dv; (2) whether autograd reaches through the forward op by itself;
(3) zero-length trailing documents (padding the document count to a bucket) change nothing;
(4) fwd+bwd time of both kernels at Qwen3-0.6B 8×4096 packed and Qwen3-4B 1×4096; (5) the
cost of a new document count (cuDNN builds a graph per shape); (6) torch.compile through a
torch.library custom op wrapping both; (7) dense causal SDPA, cuDNN against FlashAttention-2;
(8) with ``--frontend-only``: nvidia-cudnn-frontend's THD SDPA op (``cudnn.sdpa_torch``, its
wheel carried in ``.whl``) against FlashAttention-2's varlen kernel (``frontend_thd``);
(9) ``--frontend-pad``: padding and determinism; (10) ``--frontend-workspace``: the backward's
device memory by document-count bucket and ``max_seqlen`` at the Qwen3-4B recipe's shape.
"""

from __future__ import annotations

import json
import sys
import time

import torch

dev = "cuda"
res: dict = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}


def say(key, value):
    res[key] = value
    print(json.dumps({key: value}), flush=True)


def packed_cu(rows: int, width: int, lo: int, hi: int, gen) -> torch.Tensor:
    cuts = [0]
    for r in range(rows):
        pos = 0
        while pos < width:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), width - pos)
            pos += n
            cuts.append(r * width + pos)
    return torch.tensor(cuts, dtype=torch.int32, device=dev)


def flash(q, k, v, cu, m, scale):
    from torch.nn.attention.varlen import varlen_attn
    import inspect

    kw = {"scale": scale}
    params = inspect.signature(varlen_attn).parameters
    kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if "enable_gqa" in params and k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, m, m, **kw)


def cudnn_fwd(q, k, v, cu, m, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, True, 0.0, True, False, scale=scale)


class CudnnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, m, scale):
        out, lse, _, _, _, _, seed, off, _ = cudnn_fwd(q, k, v, cu, m, scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, off, cu)
        ctx.m, ctx.scale = m, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, seed, off, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            g.contiguous(), q, k, v, out, lse, seed, off, BIAS, cu, cu, ctx.m, ctx.m, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


BIAS = None


def qkv(T, hq, hkv, d, gen):
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def grads(fn, q, k, v, go):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(go)
    return out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def timeit(fn, q, k, v, go, n=20):
    for _ in range(3):
        fn(q, k, v).backward(go)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn(q, k, v).backward(go)
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def frontend_workspace(gen, cpu_gen):
    """(10) with ``--frontend-workspace``: the device memory the frontend's THD backward adds
    (its workspace, dQ/dK/dV, the re-padded LSE: peak allocated during backward over allocated
    before it) and fwd+bwd time at the Qwen3-4B 1×4096 recipe's attention (32/8 heads, d 128,
    documents of 300-3000 tokens), by the document-count bucket the count is padded to and
    by ``max_seqlen`` (the row width, or the longest document rounded up to 512)."""
    import cudnn

    fe = cudnn.sdpa_torch
    W, hq, hkv, d = 4096, 32, 8, 128
    scale = d ** -0.5
    cu = packed_cu(1, W, 300, 3000, cpu_gen)
    longest = int((cu[1:] - cu[:-1]).max())
    q, k, v = qkv(W, hq, hkv, d, gen)
    go = torch.randn(W, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    rows = []
    for bucket in (0, 8, 16, 32, 64):
        for m in (W, -(-longest // 512) * 512):
            cp = cu if bucket == 0 else torch.cat([cu, cu[-1:].expand((-(cu.numel() - 1 + 2)) % bucket + 2)])
            try:
                a, b, c = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                o = fe(a, b, c, scale=scale, is_causal=True, cu_seqlens_q=cp, cu_seqlens_kv=cp, max_seqlen_q=m,
                       max_seqlen_kv=m, return_lse=True)[0]
                o.backward(go)  # builds the graph
                for t in (a, b, c):
                    t.grad = None
                o = fe(a, b, c, scale=scale, is_causal=True, cu_seqlens_q=cp, cu_seqlens_kv=cp, max_seqlen_q=m,
                       max_seqlen_kv=m, return_lse=True)[0]
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                o.backward(go)
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - before
                ms = timeit(lambda x, y, z: fe(x, y, z, scale=scale, is_causal=True, cu_seqlens_q=cp,
                                               cu_seqlens_kv=cp, max_seqlen_q=m, max_seqlen_kv=m,
                                               return_lse=True)[0], q, k, v, go)
                rows.append({"bucket": bucket, "docs": cu.numel() - 1, "docs_padded": cp.numel() - 1,
                             "max_seqlen": m, "backward_extra_mib": extra / 2**20, "ms_fwd_bwd": ms})
            except Exception as e:  # noqa: BLE001
                rows.append({"bucket": bucket, "max_seqlen": m, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(json.dumps(rows[-1]), flush=True)
    say("fe_workspace", {"longest": longest, "rows": rows})


def main(out_path: str):
    global BIAS
    gen = torch.Generator(device=dev).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    if "--frontend-workspace" in sys.argv:
        frontend_workspace(gen, cpu_gen)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        return
    if "--frontend-pad" in sys.argv:
        frontend_pad(gen, cpu_gen)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        return
    if "--frontend-only" in sys.argv:
        frontend_thd(gen, cpu_gen)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        return
    shapes = {"qwen3-0.6b_8x4096": (8, 4096, 16, 8, 128, 256, 2048),
              "qwen3-4b_1x4096": (1, 4096, 32, 8, 128, 4096, 4096)}
    # (2) autograd through the forward op by itself
    q, k, v = qkv(512, 4, 2, 128, gen)
    cu = torch.tensor([0, 200, 512], dtype=torch.int32, device=dev)
    r = cudnn_fwd(q.detach(), k.detach(), v.detach(), cu, 512, None)
    say("forward_outputs", [[list(t.shape), list(t.stride()), str(t.dtype)] if isinstance(t, torch.Tensor) else t
                            for t in r])
    try:
        cudnn_fwd(q, k, v, cu, 512, None)[0].sum().backward()
        say("autograd_through_forward_op", "works")
    except Exception as e:  # noqa: BLE001
        say("autograd_through_forward_op", f"{type(e).__name__}: {str(e)[:200]}")
    # (1) the backward op's attn_bias: None or an empty tensor
    for name, bias in (("None", None), ("empty", torch.empty(0, device=dev))):
        BIAS = bias
        try:
            grads(lambda a, b, c: CudnnVarlen.apply(a, b, c, cu, 512, None), q, k, v, torch.ones(512, 4, 128, device=dev,
                                                                                                   dtype=torch.bfloat16))
            say(f"backward_bias_{name}", "works")
            break
        except Exception as e:  # noqa: BLE001
            say(f"backward_bias_{name}", f"{type(e).__name__}: {str(e)[:300]}")
    for label, (B, W, hq, hkv, d, lo, hi) in shapes.items():
        T = B * W
        cu = packed_cu(B, W, lo, hi, cpu_gen)
        q, k, v = qkv(T, hq, hkv, d, gen)
        go = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        scale = d ** -0.5
        f_fl = lambda a, b, c: flash(a, b, c, cu, W, scale)  # noqa: E731
        f_cd = lambda a, b, c: CudnnVarlen.apply(a, b, c, cu, W, scale)  # noqa: E731
        try:
            o1, g1 = grads(f_fl, q, k, v, go)
            o2, g2 = grads(f_cd, q, k, v, go)
            # the fp32 reference on a few documents would be better; flash vs cudnn bounds both
            say(f"{label}_rel_diff", {"out": rel(o2, o1), "dq": rel(g2[0], g1[0]), "dk": rel(g2[1], g1[1]),
                                      "dv": rel(g2[2], g1[2]), "docs": cu.numel() - 1})
            # (3) zero-length documents at the end (the count padded to a bucket)
            pad = torch.cat([cu, cu[-1:].expand(64 - (cu.numel() - 1) % 64)])
            o3, g3 = grads(lambda a, b, c: CudnnVarlen.apply(a, b, c, pad, W, scale), q, k, v, go)
            say(f"{label}_zero_length_pad", {"docs_padded": pad.numel() - 1, "out_equal": bool(torch.equal(o3, o2)),
                                             "grads_equal": all(torch.equal(a, b) for a, b in zip(g3, g2))})
            say(f"{label}_ms_fwd_bwd", {"flash": timeit(f_fl, q, k, v, go), "cudnn": timeit(f_cd, q, k, v, go, n=2)})
            # (5) a new document count
            cu2 = packed_cu(B, W, lo, hi, cpu_gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            CudnnVarlen.apply(q, k, v, cu2, W, scale).backward(go)
            torch.cuda.synchronize()
            say(f"{label}_first_call_new_doc_count_ms", {"ms": 1e3 * (time.perf_counter() - t0),
                                                         "docs": cu2.numel() - 1})
        except Exception as e:  # noqa: BLE001
            say(f"{label}_error", f"{type(e).__name__}: {str(e)[:400]}")
    # (7) dense causal SDPA (unpacked rows): which backend SDPA picks with cuDNN first, its
    # agreement with an fp32 reference and fwd+bwd time against FlashAttention-2
    dense(gen)
    # (6) compile through a custom op pair
    try:
        lib_ok = compile_probe(gen)
        say("compile_custom_op", lib_ok)
    except Exception as e:  # noqa: BLE001
        say("compile_custom_op", f"{type(e).__name__}: {str(e)[:400]}")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def dense(gen):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    for label, (B, hq, hkv, S) in {"4b_1x4096": (1, 32, 8, 4096), "06b_1x2048": (1, 16, 8, 2048)}.items():
        q = torch.randn(B, hq, S, 128, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        k = torch.randn(B, hkv, S, 128, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        v = torch.randn(B, hkv, S, 128, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        go = torch.randn(B, hq, S, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        rep = hq // hkv
        ref_fn = lambda a, b, c: sdpa(a.float(), b.float().repeat_interleave(rep, 1),  # noqa: E731
                                      c.float().repeat_interleave(rep, 1), is_causal=True)
        with sdpa_kernel(SDPBackend.MATH):
            o_ref, g_ref = grads(ref_fn, q, k, v, go)
        row = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            for gqa in (True, False):
                if gqa:
                    fn = lambda a, b, c: sdpa(a, b, c, is_causal=True, enable_gqa=True)  # noqa: E731
                else:
                    fn = lambda a, b, c: sdpa(a, b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1),  # noqa: E731
                                              is_causal=True)
                key = f"{name}_{'gqa' if gqa else 'repeat'}"
                try:
                    with sdpa_kernel(backend):
                        o, g = grads(fn, q, k, v, go)
                        ms = timeit(fn, q, k, v, go)
                    row[key] = {"ms": ms, "out": rel(o, o_ref), "dq": rel(g[0], g_ref[0]), "dk": rel(g[1], g_ref[1]),
                                "dv": rel(g[2], g_ref[2])}
                except Exception as e:  # noqa: BLE001
                    row[key] = f"{type(e).__name__}: {str(e)[:160]}"
        say(f"dense_{label}", row)


def frontend_thd(gen, cpu_gen):
    """(8) nvidia-cudnn-frontend's THD (packed, ``cu_seqlens``) SDPA torch op against
    FlashAttention-2's varlen kernel at the Qwen3-0.6B packed shape: error against an fp32
    reference of the first row's documents, fwd+bwd time, the first call at a new document count
    (its graph cache is keyed on it), zero-length documents padding the count to a bucket, and
    torch.compile through the op."""
    try:
        import cudnn

        fe = cudnn.sdpa_torch
        say("frontend", {"version": getattr(cudnn, "__version__", "?"), "backend": cudnn.backend_version()})
    except Exception as e:  # noqa: BLE001
        say("frontend", f"{type(e).__name__}: {str(e)[:300]}")
        return
    from pgs.runtime.model.attention import _reference

    B, W, hq, hkv, d = 8, 4096, 16, 8, 128
    scale = d ** -0.5
    cu = packed_cu(B, W, 256, 2048, cpu_gen)
    q, k, v = qkv(B * W, hq, hkv, d, gen)
    go = torch.randn(B * W, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)

    def f_fe(a, b, c, cu_=cu):
        return fe(a, b, c, scale=scale, is_causal=True, cu_seqlens_q=cu_, cu_seqlens_kv=cu_, max_seqlen_q=W,
                  max_seqlen_kv=W, return_lse=True)[0]

    f_fl = lambda a, b, c: flash(a, b, c, cu, W, scale)  # noqa: E731
    try:
        # fp32 reference on the first row (its documents only): [W, H, D]
        row = slice(0, W)
        cu0 = cu[cu <= W]
        def ref_fn(a, b, c):
            return _reference(a[row].float(), b[row].float(), c[row].float(), cu0, 1, W, scale)

        o_ref, g_ref = grads(ref_fn, q, k, v, go[row])
        out = {}
        for name, fn in (("flash", f_fl), ("cudnn_fe", f_fe)):
            o, g = grads(fn, q, k, v, go)
            # the reference saw only the first row: compare there (its gradient is zero elsewhere)
            out[name] = {"out": rel(o[row], o_ref), "dq": rel(g[0][row], g_ref[0][row]),
                         "dk": rel(g[1][row], g_ref[1][row]), "dv": rel(g[2][row], g_ref[2][row])}
        say("fe_thd_rel_error_vs_fp32", out)
        say("fe_thd_ms_fwd_bwd", {"flash": timeit(f_fl, q, k, v, go), "cudnn_fe": timeit(f_fe, q, k, v, go),
                                   "docs": cu.numel() - 1})
        pad = torch.cat([cu, cu[-1:].expand(64 - (cu.numel() - 1) % 64)])
        o2, g2 = grads(f_fe, q, k, v, go)
        o3, g3 = grads(lambda a, b, c: f_fe(a, b, c, pad), q, k, v, go)
        say("fe_thd_zero_length_pad", {"docs_padded": pad.numel() - 1, "out_equal": bool(torch.equal(o3, o2)),
                                       "grads_equal": all(torch.equal(a, b) for a, b in zip(g3, g2))})
        cu2 = packed_cu(B, W, 256, 2048, cpu_gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f_fe(q, k, v, cu2).backward(go)
        torch.cuda.synchronize()
        say("fe_thd_first_call_new_doc_count_ms", {"ms": 1e3 * (time.perf_counter() - t0), "docs": cu2.numel() - 1})
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        c = torch.compile(lambda a, b, cc: f_fe(a, b, cc).float().square().mean(), fullgraph=True)
        for t in (q, k, v):
            t.grad = None
        c(q, k, v).backward()
        gc_ = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        f_fe(q, k, v).float().square().mean().backward()
        say("fe_thd_compile", {"grads_equal_eager": all(torch.equal(a, t.grad) for a, t in zip(gc_, (q, k, v)))})
    except Exception as e:  # noqa: BLE001
        import traceback

        say("fe_thd_error", f"{type(e).__name__}: {str(e)[:300]} | {traceback.format_exc()[-600:]}")


def frontend_pad(gen, cpu_gen):
    """(9) with ``--frontend-pad``: is the frontend's THD backward deterministic (two calls,
    same inputs); how far apart are a call with the document count padded by zero-length
    documents to a multiple of 64 and the unpadded call, against FA2's own run-to-run spread;
    fwd+bwd time padded; the first call of each new count inside one bucket (no build
    expected)."""
    import cudnn

    fe = cudnn.sdpa_torch
    B, W, hq, hkv, d = 8, 4096, 16, 8, 128
    scale = d ** -0.5

    def pad64(cu):
        return torch.cat([cu, cu[-1:].expand((-(cu.numel() - 1)) % 64)])

    def f_fe(a, b, c, cu_):
        return fe(a, b, c, scale=scale, is_causal=True, cu_seqlens_q=cu_, cu_seqlens_kv=cu_, max_seqlen_q=W,
                  max_seqlen_kv=W, return_lse=True)[0]

    cu = packed_cu(B, W, 256, 2048, cpu_gen)
    q, k, v = qkv(B * W, hq, hkv, d, gen)
    go = torch.randn(B * W, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    try:
        o1, g1 = grads(lambda a, b, c: f_fe(a, b, c, cu), q, k, v, go)
        o2, g2 = grads(lambda a, b, c: f_fe(a, b, c, cu), q, k, v, go)
        o3, g3 = grads(lambda a, b, c: f_fe(a, b, c, pad64(cu)), q, k, v, go)
        f1 = grads(lambda a, b, c: flash(a, b, c, cu, W, scale), q, k, v, go)
        f2 = grads(lambda a, b, c: flash(a, b, c, cu, W, scale), q, k, v, go)
        say("fe_pad_determinism", {
            "fe_repeat_grads_equal": [bool(torch.equal(a, b)) for a, b in zip(g1, g2)],
            "fe_repeat_rel": [rel(a, b) for a, b in zip(g1, g2)],
            "fe_pad_out_equal": bool(torch.equal(o1, o3)),
            "fe_pad_rel": [rel(a, b) for a, b in zip(g3, g1)],
            "flash_repeat_rel": [rel(a, b) for a, b in zip(f2[1], f1[1])],
            "fe_vs_flash_rel": [rel(a, b) for a, b in zip(g1, f1[1])]})
        cp = pad64(cu)
        say("fe_pad_ms_fwd_bwd", {"flash": timeit(lambda a, b, c: flash(a, b, c, cu, W, scale), q, k, v, go),
                                  "cudnn_fe": timeit(lambda a, b, c: f_fe(a, b, c, cu), q, k, v, go),
                                  "cudnn_fe_pad64": timeit(lambda a, b, c: f_fe(a, b, c, cp), q, k, v, go),
                                  "docs": cu.numel() - 1})
        firsts = []
        for _ in range(6):
            c2 = packed_cu(B, W, 256, 2048, cpu_gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f_fe(q, k, v, pad64(c2)).backward(go)
            torch.cuda.synchronize()
            firsts.append({"docs": c2.numel() - 1, "ms": 1e3 * (time.perf_counter() - t0)})
        say("fe_pad_first_calls", firsts)
    except Exception as e:  # noqa: BLE001
        import traceback

        say("fe_pad_error", f"{type(e).__name__}: {str(e)[:300]} | {traceback.format_exc()[-600:]}")


def compile_probe(gen):
    @torch.library.custom_op("pgsprobe::cudnn_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, m: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse, _, _, _, _, seed, off, _ = cudnn_fwd(q, k, v, cu, m, scale)
        return out, lse, seed, off

    @fwd.register_fake
    def _(q, k, v, cu, m, scale):
        T, h, d = q.shape
        return (q.new_empty(T, h, d), q.new_empty(T, h, 1, dtype=torch.float32),
                q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64))

    @torch.library.custom_op("pgsprobe::cudnn_bwd", mutates_args=())
    def bwd(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, seed: torch.Tensor, off: torch.Tensor, cu: torch.Tensor, m: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.ops.aten._cudnn_attention_backward(g.contiguous(), q, k, v, out, lse, seed, off, BIAS, cu, cu,
                                                        m, m, 0.0, True, scale=scale)

    @bwd.register_fake
    def _(g, q, k, v, out, lse, seed, off, cu, m, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup(ctx, inputs, output):
        q, k, v, cu, m, scale = inputs
        out, lse, seed, off = output
        ctx.save_for_backward(q, k, v, out, lse, seed, off, cu)
        ctx.m, ctx.scale = m, scale

    def backward(ctx, g, *_):
        q, k, v, out, lse, seed, off, cu = ctx.saved_tensors
        dq, dk, dv = bwd(g, q, k, v, out, lse, seed, off, cu, ctx.m, ctx.scale)
        return dq, dk, dv, None, None, None

    fwd.register_autograd(backward, setup_context=setup)

    q, k, v = qkv(4096, 16, 8, 128, gen)
    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32, device=dev)
    lin = torch.nn.Linear(128, 128, device=dev, dtype=torch.bfloat16)

    def layer(q, k, v, cu):
        return lin(fwd(q, k, v, cu, 4096, 128 ** -0.5)[0]).float().square().mean()

    eager = layer(q, k, v, cu)
    eager.backward()
    ge = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    c = torch.compile(layer, fullgraph=True)
    out = c(q, k, v, cu)
    out.backward()
    same = all(torch.equal(a, t.grad) for a, t in zip(ge, (q, k, v)))
    cu3 = torch.tensor([0, 10, 3000, 4096], dtype=torch.int32, device=dev)
    c(q, k, v, cu3).backward()
    return {"loss_equal": bool(torch.equal(out, eager)), "grads_equal": same}


if __name__ == "__main__":
    main(next((a for a in sys.argv[1:] if not a.startswith("--")), "/tmp/attn_cudnn.json"))
