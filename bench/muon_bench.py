"""Batched Muon (pgs) vs torch.optim.Muon at Qwen3-1.7B hidden-matrix shapes.

Not a test.  Times one optimizer step over the 28 layers' hidden matrices
(q 2048×2048, k/v 1024×2048, o 2048×2048, gate/up 6144×2048, down 2048×6144) for:

- ``pgs``: ``pf.muon``'s Muon branch (momentum, one batched bf16 Newton–Schulz per oriented
  shape, decoupled decay, lr), update + apply;
- ``torch``: ``torch.optim.Muon.step()`` (one matrix at a time);
- ``fast[K]``: ``muon_fused_step`` (pre pass, batched NS with kernel K = auto (the default:
  the tuned symmetric config per shape on sm_90), cublas or a named symmetric Triton config,
  post pass; ``,nofold`` keeps aX + BX), and pure NS per shape group with each kernel
  (TFLOP/s, and ``rel_err_vs_fp64``: the distance to an fp64 NS5 of the same input);

and reports milliseconds and the ratio to the Newton–Schulz matmul floor:
FLOPs(NS5 over all matrices) / peak (789 TFLOP/s dense bf16 by default, ``--peak-tflops``).

    python -m bench optim-muon              # on the GPU
    python -m bench optim-muon --small      # CPU smoke: 2 layers, shapes / 16
    python bench/muon_bench.py OUT.json     # the script alone (its JSON path comes first)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import pgs.func as pf

QWEN3_1_7B = {"q": (2048, 2048), "k": (1024, 2048), "v": (1024, 2048), "o": (2048, 2048),
              "gate": (6144, 2048), "up": (6144, 2048), "down": (2048, 6144)}


def shapes(small: bool) -> dict[str, tuple[int, int]]:
    layers = 2 if small else 28
    div = 16 if small else 1
    return {f"layers.{i}.{k}": (r // div, c // div) for i in range(layers) for k, (r, c) in QWEN3_1_7B.items()}


def ns_flops(shape_map: dict, steps: int = 5) -> float:
    """Matmul FLOPs of NS_k: per iteration 2m²n (X Xᵀ) + 2m³ (A·A) + 2m²n (B X), m ≤ n."""
    total = 0.0
    for r, c in shape_map.values():
        m, n = min(r, c), max(r, c)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def group_flops(m: int, n: int, batch: int, steps: int = 5, symmetric: bool = False) -> float:
    m, n = min(m, n), max(m, n)
    per = (2 * m * m * n + m**3 + 2 * m * m * n) if symmetric else (4 * m * m * n + 2 * m**3)
    return steps * per * batch


def ns_fp64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """NS_k of an already normalised batch in fp64 (no renormalisation): the accuracy yardstick."""
    import importlib

    a, b, c = (float(v) for v in importlib.import_module("pgs.func.muon_direction").NS_COEFFICIENTS)
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def rel_err(o: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over the batch of ‖o − exact‖_F / ‖exact‖_F."""
    return ((o.double() - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).mean().item()


def attempt(fn):
    try:
        return fn(), None
    except Exception as e:  # a config that does not compile or fit is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="path of the JSON report")
    ap.add_argument("--small", action="store_true", help="CPU smoke: 2 layers, shapes / 16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=789.0, help="dense bf16 peak used for the floor")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    ap.add_argument("--configs", default="all", help="symmetric-kernel configs, comma-separated, 'all' or 'none'")
    args = ap.parse_args()

    import pgs.func.muon_direction as M
    from pgs.func.kernels import ns as NS

    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = getattr(torch, args.dtype)
    smap = shapes(args.small)
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(device=device, dtype=dtype) * 0.02 for k, s in smap.items()}
    grads = {k: torch.randn(s, generator=gen).to(device=device, dtype=dtype) for k, s in smap.items()}
    lr, wd = 0.02, 0.1
    if args.configs == "all":
        configs = list(NS.CONFIGS) if NS.HAVE_TRITON else []
    elif args.configs == "none":
        configs = []
    else:
        configs = args.configs.split(",")
    if device.type != "cuda":
        # CPU smoke: Triton runs only in the interpreter there (slow): one config, tiny sizes
        configs = configs[:1] if NS.HAVE_TRITON and M._interpreting() else []
    flops = ns_flops(smap)
    floor_ms = flops / (args.peak_tflops * 1e12) * 1e3
    results: dict[str, dict] = {}
    t_start = time.perf_counter()
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "small": args.small, "param_dtype": args.dtype, "num_matrices": len(smap),
            "ns_flops": flops, "peak_tflops": args.peak_tflops, "floor_ms": floor_ms, "iters": args.iters}

    def dump(extra=None):  # written after every measurement: a crash keeps what was measured
        with open(args.out, "w") as f:
            json.dump({**meta, "results": results, **(extra or {})}, f, indent=2)

    def record(name, ms, err=None, **more):
        row = {"ms": ms, "over_floor": None if ms is None else ms / floor_ms, **more}
        if err:
            row["error"] = err
        results[name] = row
        shown = "failed: " + err if err else f"{ms:8.2f} ms  {ms / floor_ms:5.2f}x floor"
        print(f"{name:34s} {shown}", flush=True)
        dump()

    # torch.optim.Muon (one matrix at a time)
    tparams = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for tp, g in zip(tparams, grads.values()):
        tp.grad = g.clone()
    topt = torch.optim.Muon(tparams, lr=lr, weight_decay=wd)
    record("torch.optim.Muon", timed(topt.step, device, args.warmup, args.iters))
    del topt, tparams

    # the reference path: chain(scale_by_muon, add_decayed_weights, scale_by_learning_rate) + apply
    opt = pf.chain(pf.scale_by_muon(), pf.add_decayed_weights(wd), pf.scale_by_learning_rate(lr))
    state = {"s": opt.init(params), "p": {k: v.clone() for k, v in params.items()}}

    def ref_step():
        u, state["s"] = opt.update(grads, state["s"], state["p"])
        state["p"] = pf.apply_updates(state["p"], u)

    record("reference (chain + apply)", timed(ref_step, device, args.warmup, args.iters))
    state.clear()  # frees the reference's momenta and parameters

    # the fast path: pre pass -> batched NS -> post pass, in place
    fp = [p.clone() for p in params.values()]
    fm = [torch.zeros_like(p) for p in params.values()]
    gl = list(grads.values())
    lr_t = torch.tensor(lr, dtype=torch.float64, device=device)  # as a schedule gives it: no recompiles

    # "auto": the default (tuned symmetric config per shape on sm_90, fold); "auto,nofold": the
    # same kernel keeping the reference's aX + BX (what exactness costs)
    variants = [("auto", None), ("auto", False), ("cublas", False), ("cublas", True)] + [(c, True) for c in configs]

    def vname(kernel, fold):
        return kernel + ("" if fold is not False else ",nofold")

    for kernel, fold in variants:
        def fast_step(kernel=kernel, fold=fold):
            M.muon_fused_step(fp, gl, fm, learning_rate=lr_t, weight_decay=wd, ns_kernel=kernel, fold=fold)

        ms, err = attempt(lambda: timed(fast_step, device, args.warmup, args.iters))
        record(f"fast[{vname(kernel, fold)}]", ms, err)

    # the same through the execution layer: pf.compile(muon_matrices(...), donate=True).step on
    # parameters and gradients re-homed into the flat layout's buffers (as pgs.runtime.optim.bound does)
    best_kernel = "auto"  # what pf.compile(muon_matrices(...)) uses by default

    def compiled():
        fast = pf.compile(M.muon_matrices(lr, weight_decay=wd, ns_kernel=best_kernel), donate=True)
        cp = {k: v.clone() for k, v in params.items()}
        cg = {k: v.clone() for k, v in grads.items()}
        fast.bind_buffers(cp)
        fast.bind_buffers(cg)
        st = {"s": fast.init(cp)}

        def step():
            _, st["s"] = fast.step(cg, st["s"], cp)

        return timed(step, device, args.warmup, args.iters)

    ms, err = attempt(compiled)
    record(f"pf.compile(muon_matrices).step[{best_kernel}]", ms, err)

    # correctness of the fast path against the reference, one step from the same state
    p0 = {k: v.clone() for k, v in params.items()}
    u, _ = opt.update(grads, opt.init(p0), p0)
    ref1 = pf.apply_updates(p0, u)
    check = {}
    for kernel, fold in variants:
        if results[f"fast[{vname(kernel, fold)}]"].get("error"):
            continue
        p1 = [v.clone() for v in params.values()]
        M.muon_fused_step(p1, gl, [torch.zeros_like(v) for v in p1], learning_rate=lr, weight_decay=wd,
                          ns_kernel=kernel, fold=fold)
        d = max(((a.float() - b.float()).norm() / (b.float() - p.float()).norm().clamp(min=1e-30)).item()
                for a, b, p in zip(p1, ref1.values(), params.values()))
        check[vname(kernel, fold)] = d
    print("max over tensors of |fast - reference| / |reference step| (Frobenius):", check, flush=True)

    # pure Newton-Schulz per oriented-shape group (no elementwise work): achieved TFLOP/s
    per_group = {}
    groups: dict[tuple, int] = {}
    for s in smap.values():
        groups[s] = groups.get(s, 0) + 1
    for (r, c), b in groups.items():
        x0 = torch.randn((b, r, c), generator=gen).to(device=device, dtype=torch.bfloat16)
        x0 /= torch.linalg.vector_norm(x0.float(), dim=(-2, -1), keepdim=True).to(torch.bfloat16)
        row = {"batch": b, "shape": [r, c], "flops": group_flops(r, c, b)}
        ref_o = M.newton_schulz_batched(x0.clone(), 5, kernel="cublas", fold=False)  # the reference's products
        exact = ns_fp64(x0)  # the same iteration in fp64 on the same (normalised) input
        for asked, fold in variants:
            kernel = M._pick_kernel(asked, x0)  # "auto" resolved as muon_fused_step resolves it
            xs = [x0.clone() for _ in range(2)]  # the iteration overwrites its input: no clone timed

            def run(kernel=kernel, fold=fold):
                M.newton_schulz_batched(xs[0], 5, kernel=kernel, fold=fold)

            ms, err = attempt(lambda: timed(run, device, 2, max(3, args.iters // 2)))
            name = vname(asked, fold) + (f"={kernel}" if asked == "auto" else "")
            if err:
                row[name] = {"error": err}
                continue
            o = M.newton_schulz_batched(xs[1], 5, kernel=kernel, fold=fold)
            row[name] = {"ms": ms, "tflops_nominal": row["flops"] / ms / 1e9,
                           "tflops_executed": group_flops(r, c, b, symmetric=kernel != "cublas") / ms / 1e9,
                           "max_abs_diff_vs_cublas": (o.float() - ref_o.float()).abs().max().item(),
                           "rel_err_vs_fp64": rel_err(o, exact)}
        row["reference_rel_err_vs_fp64"] = rel_err(ref_o, exact)
        del exact
        per_group[f"{b}x{r}x{c}"] = row
        dump({"ns_per_group": per_group})
        print(f"NS {b}x{r}x{c}: " + ", ".join(
            f"{k} {v['ms']:.2f} ms {v['tflops_nominal']:.0f} TF/s" if "ms" in v else f"{k} {v['error'][:60]}"
            for k, v in row.items() if isinstance(v, dict)), flush=True)

    errs = {g: {k: round(v["rel_err_vs_fp64"], 5) for k, v in row.items()
                if isinstance(v, dict) and "rel_err_vs_fp64" in v} for g, row in per_group.items()}
    print("NS rel. error vs fp64 (mean over the batch, Frobenius): " + json.dumps(errs), flush=True)
    best = min((v["ms"], k) for k, v in results.items() if k.startswith("fast") and v["ms"] is not None)
    report = {
        **meta,
        "results": results,
        "best_fast": {"name": best[1], "ms": best[0], "over_floor": best[0] / floor_ms},
        "fast_vs_reference_rel_err": check,
        "ns_per_group": per_group,
        "pgs_ms": results["reference (chain + apply)"]["ms"],
        "torch_ms": results["torch.optim.Muon"]["ms"],
        "wall_s": time.perf_counter() - t_start,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("floor_ms", "best_fast", "fast_vs_reference_rel_err", "wall_s")}, indent=2))


if __name__ == "__main__":
    main()
