"""One SFT training step, HF baselines against pgs, at Qwen3-4B and Qwen3-0.6B shapes.

Run on one GPU (written for an H200; not a test):

    python -m bench sft-step --shapes qwen3-4b
    python -m bench sft-step --shapes qwen3-0.6b
    python -m bench sft-step --only pgs_release,hf_compiled_ac --shapes qwen3-4b
    python -m bench sft-step --small        # CPU smoke, tiny shapes

Variants (every one with random-init weights from the config, bf16; ``_ac``: activation
checkpointing of every decoder layer):

- ``hf_eager_ac``: transformers' model and loss (full logits) + ``torch.optim.AdamW(fused=True)``.
- ``hf_compiled_ac``: the same, each decoder layer ``torch.compile``'d.
- ``hf_liger_ac``: the same as eager with Liger's kernels (fused linear CE), if importable.
- ``hf_compiled``, ``hf_liger``: the same without checkpointing (the fastest HF setups when
  memory allows, e.g. Qwen3-0.6B 8×4096 on an H200).
- ``pgs_release``: ``GradientRelease`` (the update inside backward, gradients freed at once)
  with ``pf.lion8bit``, stochastic rounding into the bf16 weights, each group stepped by the
  fused in-place kernel (one per tensor), the chunked loss (``pgs.func.losses``, never [N, V]
  logits) with the tied head's gradient deferred into the embedding's, compiled layers.
- ``pgs_release_unfused``: the same through the chain's plain update and θ + u in slabs,
  without the deferral (the path before the fused release; for comparison).
- ``pgs_release_eager``: ``pgs_release`` without compiled layers (where the host time goes).
- ``pgs_release_noac``: ``pgs_release`` without checkpointing.
- ``pgs_release_slabs``: ``pgs_release`` with the layer inputs offloaded to pinned host memory
  and the tied weight stepped in row slabs (``GradientRelease(..., tied_slabs=SLAB_ROWS)``: no
  dense V×D gradient at the end of backward); ``pgs_release_slabs_pg``: the same with one
  release group per parameter (a layer's gradients never all exist at once) (docs/memory.md);
  ``pgs_release_slabs_pg_tiled``: and each decoder MLP computed in ``--mlp-tiles`` token slices
  (``pgs.runtime.model.tiled_mlp``); ``pgs_release_tiled``: ``pgs_release`` with the tiled MLP only.
- ``pgs_release_slabs_pg_sub``, ``pgs_release_slabs_sub``: the slab variants with the
  ``"sublayer"`` checkpoint policy (each layer's attention half and MLP half checkpointed
  apart, both inputs offloaded), per-parameter or per-layer release groups.
- ``pgs_release_noac_liger``: ``pgs_release_noac`` with Liger's layer kernels (RMSNorm, RoPE,
  SwiGLU) instead of compiled layers (pgs's own chunked loss either way).
- any variant with ``+cudnnthd`` / ``+fa2`` appended (after ``_varlen``, ``SWITCHES``): ``_varlen`` attention on cuDNN's THD kernel / FlashAttention-2 (``model.varlen_kernel``
  "cudnn" / "flash"; without either, "auto": cuDNN on an H200 with nvidia-cudnn-frontend).
- any variant with ``_varlen`` appended: the same with ``attn_implementation="varlen"``
  (packed documents without cross-document attention work; docs/data.md).
- an HF variant with ``_causal`` appended: a packed shape's rows as single causal sequences
  (no document isolation: what the peer rows of docs/performance.md, "Peers and ceilings", measured).

Default variants per shape (``SHAPE_VARIANTS``); ``--only`` picks any.  The chunked loss's
chunk is per shape unless ``--loss-chunk`` is given (``default_loss_chunk``): 256 rows at 4B
while the deferred head gradient is rebuilt in fp32 at the end of backward (8 B per chunk
element: 0.29 GiB at 256 rows, 1.16 at 1024), 1024 once it is rebuilt with the loss's Triton
pass (``DeferredHeadGrad.KERNEL_PASS``, 2 B per element); 2048 at 0.6B.  For pgs variants the
``pgs profile`` prediction (``predict_memory``) is recorded beside the measurement.

Reported per variant and shape: tok/s, MFU = (6N + 6·L·n_q·d_head·S)·tok/s / 790e12 (N: all
parameters, the tied head once), peak allocated GiB (timed steps, and including warm-up),
the final loss; an error string instead when a variant fails (OOM included), after which
memory is freed and the next variant runs.  JSON goes to ``--out``.
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
from typing import Callable

if "--triton-on-cpu" in sys.argv:  # before triton is imported: its interpreter, then pgs's CPU switch
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

if "--triton-on-cpu" in sys.argv:
    from pgs.func.kernels import configure

    configure(triton_on_cpu=True)

H200_BF16_FLOPS = 790e12

SHAPES = {
    # name: (config table, batch, seq)
    "qwen3-4b": (dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0), 1, 4096),
    "qwen3-0.6b": (dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                        tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0), 8, 4096),
}
SMALL_SHAPES = {
    "tiny": (dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  tie_word_embeddings=True), 2, 64),
}
BASE_VARIANTS = ("hf_eager_ac", "hf_compiled_ac", "hf_liger_ac", "hf_compiled", "hf_liger",
                 "pgs_release", "pgs_release_unfused", "pgs_release_eager", "pgs_release_noac",
                 "pgs_release_slabs", "pgs_release_slabs_pg", "pgs_release_slabs_pg_tiled", "pgs_release_tiled",
                 "pgs_release_noac_liger", "pgs_release_slabs_pg_sub", "pgs_release_slabs_sub")
#: every variant also runs with ``attn_implementation="varlen"`` (suffix ``_varlen``): packed
#: documents through FlashAttention's variable-length kernel (pgs.runtime.model.attention); the HF
#: variants then get the boundaries as keyword arguments, as TRL's flattening collator gives them
VARIANTS = BASE_VARIANTS + tuple(v + "_varlen" for v in BASE_VARIANTS)
#: suffix ``_causal`` (HF variants): the packed shapes' rows fed as single causal sequences
#: (positions 0..S-1, no document boundaries, so documents attend to each other): the setup of
#: the 0.6B peer rows of docs/performance.md (HF + Liger eager, 83.5k tok/s), the issue's reference
VARIANTS += tuple(v + "_causal" for v in BASE_VARIANTS if v.startswith("hf_"))


#: runtime switches a variant name may carry as ``+suffix`` (e.g.
#: ``pgs_release_slabs_sub+sf+pool``): (module, attribute, environment variable, value) set for that
#: variant only (its child process gets the variable; ``--same-process`` sets the attribute)
SWITCHES = {# the packed-attention kernel (model.varlen_kernel; "auto" picks cuDNN's THD kernel on an
            # H200 when nvidia-cudnn-frontend is installed): for the pgs and HF _varlen rows alike
            "fa2": ("pgs.runtime.model.attention", "_kernel", "PGS_BENCH_VARLEN_KERNEL", "flash"),
            "cudnnthd": ("pgs.runtime.model.attention", "_kernel", "PGS_BENCH_VARLEN_KERNEL", "cudnn")}


def _env_value(value) -> str:
    return value if isinstance(value, str) else "1" if value else "0"


def split_switches(name: str) -> tuple[str, list[str]]:
    """``(variant without its +switches, the switches)``."""
    base, *switches = name.split("+")
    return base, switches


def apply_switches(switches: list[str]) -> Callable[[], None]:
    """Set the switches' attributes; returns the undo (``--same-process`` runs later variants)."""
    import importlib

    undo = []
    for s in switches:
        module, attr, _, value = SWITCHES[s]
        owner = importlib.import_module(module)
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        undo.append((owner, last, getattr(owner, last)))
        setattr(owner, last, value)

    def restore():
        for owner, last, before in reversed(undo):
            setattr(owner, last, before)
    return restore


def split_name(name: str) -> tuple[str, str]:
    """``(base variant, attention implementation)``."""
    name = split_switches(name)[0].removesuffix("_causal")
    if name.endswith("_varlen"):
        return name[: -len("_varlen")], "varlen"
    return name, "sdpa"

#: rows per slab of the tied weight for the ``_slabs`` variants (rows × hidden must be a
#: multiple of lion8bit's 256-element blocks)
SLAB_ROWS = {"qwen3-4b": 32768, "qwen3-0.6b": 8192, "tiny": 128}  # 4B: 5 slabs
SHAPE_VARIANTS = {
    "qwen3-4b": ("hf_eager_ac", "hf_compiled_ac", "hf_liger_ac", "pgs_release", "pgs_release_unfused"),
    "qwen3-0.6b": ("hf_compiled", "hf_liger", "hf_compiled_ac", "pgs_release_noac", "pgs_release"),
    "tiny": VARIANTS,
}
LOSS_CHUNK = {"qwen3-4b": 256, "qwen3-0.6b": 2048, "tiny": 32}
#: where the deferred head gradient is rebuilt with the loss's Triton pass
#: (``DeferredHeadGrad.KERNEL_PASS``: 2 B per chunk element instead of 8), a 4B chunk of 1024
#: rows costs what 256 did (``pgs profile``: 12.94 GiB either way)
LOSS_CHUNK_KERNEL_REBUILD = {"qwen3-4b": 1024, "qwen3-0.6b": 2048, "tiny": 32}


def default_loss_chunk(shape: str) -> int:
    from pgs.func.losses.chunked import DeferredHeadGrad

    table = LOSS_CHUNK_KERNEL_REBUILD if getattr(DeferredHeadGrad, "KERNEL_PASS", False) else LOSS_CHUNK
    return table[shape]
PACKED = {"qwen3-0.6b", "tiny"}


def build(table: dict, device: torch.device, attn: str = "sdpa", experts: str = "auto"):
    """The HF model of ``table`` (random init, seed 0, bf16) on ``device``; ``experts``: a
    mixture-of-experts model's expert implementation (``model.experts_implementation``;
    ``"auto"``: transformers' default)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pgs.runtime.model.attention import hf_implementation
    from pgs.runtime.model.moe import experts_implementation

    cfg_table = dict(table)
    cfg = AutoConfig.for_model(cfg_table.pop("model_type"), **cfg_table)
    cfg.use_cache = False
    chosen = experts_implementation(experts, cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=hf_implementation(attn),
                                                 **({} if chosen is None else {"experts_implementation": chosen}))
    return model.train()


def make_batch(vocab: int, batch: int, seq: int, device, packed: bool, gen: torch.Generator):
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    if packed:  # documents of random length, positions restarting at each (what packing feeds)
        pos = torch.empty(batch, seq, dtype=torch.long)
        for r in range(batch):
            at = 0
            while at < seq:
                n = min(seq - at, int(torch.randint(256, 2048, (1,), generator=gen)))
                pos[r, at:at + n] = torch.arange(n)
                at += n
    else:
        pos = torch.arange(seq).expand(batch, seq).clone()
    return ids.to(device), pos.to(device)


def flops_per_token(model, seq: int) -> float:
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 6 * n + 6 * c.num_hidden_layers * c.num_attention_heads * d * seq


def uses_ac(name: str) -> bool:
    name = split_name(name)[0]
    return (name.endswith("_ac") or name in ("pgs_release", "pgs_release_unfused", "pgs_release_eager", "pgs_release_tiled")
            or _slabs(name))


def _slabs(name: str) -> bool:
    return name.startswith("pgs_release_slabs")


def _per_parameter(name: str) -> bool:
    return "_pg" in split_name(name)[0]


def _policy(name: str) -> str:
    return "sublayer" if split_name(name)[0].endswith("_sub") else "full"


def _tiled(name: str) -> bool:
    return split_name(name)[0].endswith("_tiled")


def variant_setup(name: str, model, args, loss_chunk: int, slab_rows: int | None = None):
    """``step(ids, pos) -> loss`` for one variant (builds its optimizer and patches the model)."""
    import pgs.func as pf
    from pgs.runtime.model.attention import packed_kwargs, uses_varlen

    name = split_name(name)[0]
    from pgs.runtime.model.layers import apply_activation_checkpointing, apply_liger, compile_layers

    compile_kw = {"backend": args.compile_backend} if args.compile_backend else {}
    if getattr(args, "compile_options", None):  # inductor options for every compiled layer (HF's too)
        compile_kw["options"] = json.loads(args.compile_options)
    if "_liger" in name:
        apply_liger(model)  # before checkpointing wraps the layers' forwards
    if _tiled(name):
        from pgs.runtime.model.tiled_mlp import apply_mlp_tiles

        apply_mlp_tiles(model, args.mlp_tiles)
    if uses_ac(name):  # HF: torch.utils.checkpoint, as transformers' gradient checkpointing
        apply_activation_checkpointing(model, _policy(name), offload=_slabs(name),
                                       fast_recompute=None if name.startswith("pgs_") else False)
    if name.startswith("hf_"):
        if name.startswith("hf_compiled"):
            compile_layers(model, **compile_kw)
        fused = model.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=fused)

        varlen = uses_varlen(model)

        def step(ids, pos, labels=None):  # labels: HF's unshifted targets (default: every token)
            extra = packed_kwargs(pos) if varlen else {}
            loss = model(input_ids=ids, position_ids=pos, labels=ids if labels is None else labels, **extra).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, opt

    from pgs.func.losses import token_loss
    from pgs.runtime.model.build import final_hidden, output_head
    from pgs.runtime.optim.release import GradientRelease

    if name not in ("pgs_release_eager", "pgs_release_noac_liger"):
        compile_layers(model, **compile_kw)
    new_path = name != "pgs_release_unfused"
    backend = "triton" if (args.small and args.triton_on_cpu) else "auto"
    slabs = slab_rows if _slabs(name) else None
    release = GradientRelease(pf.lion8bit(1e-5, backend=backend), model,
                              memory=pf.MemoryOptions(stochastic_rounding=True, tied_slabs=slabs or 0),
                              track_grad_norm=False, fused=new_path,
                              groups="parameter" if _per_parameter(name) else "layer")
    W0 = output_head(model)[0]
    defer = new_path and W0 is model.get_input_embeddings().weight and defers(name, args)
    if args.no_defer and slabs:
        raise ValueError("--no-defer: the _slabs variants rebuild the head's gradient slab by slab (they need the "
                         "deferral)")

    def step(ids, pos):
        h = final_hidden(model, ids, pos)
        W, bias, softcap = output_head(model)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100  # as HF's shifted loss: the last position has no target
        r = token_loss(h, W, labels, bias=bias, softcap=softcap, chunk_size=loss_chunk, memory=pf.MemoryOptions(defer_head_grad=defer))
        if defer:  # in row slabs the release rebuilds the head's rows slab by slab: hand it the object
            release.before_step(W, r.head_grad if slabs else r.head_grad.add_to)
        loss = r.loss_sum / r.num_valid
        loss.backward()  # the update runs inside
        return loss.detach()

    return step, release


def defers(name: str, args) -> bool:
    """Whether a pgs variant defers the tied head's gradient: as ``memory.defer_head_grad = "auto"``
    (with checkpointing or slabs) unless ``--defer`` / ``--no-defer`` say otherwise."""
    from pgs.runtime.optim.memory import head_grad_wanted

    setting = bool(args.defer) if (args.defer or args.no_defer) else "auto"
    return head_grad_wanted(setting, "full" if uses_ac(name) else "none", _slabs(split_name(name)[0]))


def predicted_peak_gib(name: str, table: dict, batch: int, seq: int, loss_chunk: int,
                       slab_rows: int | None = None, mlp_tiles: int = 0, defer: bool = True) -> float | None:
    """``pgs profile``'s prediction for a pgs variant (None for HF variants, or when it fails)."""
    if not name.startswith("pgs_"):
        return None
    name = split_name(name)[0]
    try:
        import pgs.func as pf
        from pgs.runtime.tools.profile import GiB, predict_memory

        new_path = name != "pgs_release_unfused"
        pred = predict_memory(dict(table), dtype=torch.bfloat16, chain=pf.lion8bit(1e-5), gradient_release=True,
                              activation_checkpointing=_policy(name) if uses_ac(name) else "none",
                              micro_batch_tokens=batch * seq, loss_chunk=loss_chunk,
                              fused_update=new_path, defer_head_grad=new_path and defer,
                              checkpoint_offload=_slabs(name), tied_slabs=slab_rows if _slabs(name) else None,
                              release_groups="parameter" if _per_parameter(name) else "layer",
                              mlp_tiles=mlp_tiles if _tiled(name) else 0,
                              compiled_layers=name not in ("pgs_release_eager", "pgs_release_noac_liger"))
        return pred["peak"] / GiB
    except Exception:  # noqa: BLE001 - a prediction is a bonus
        return None


def run_variant(name: str, shape: str, args, device) -> dict:
    table, batch, seq = (SMALL_SHAPES if args.small else SHAPES)[shape]
    loss_chunk = args.loss_chunk or default_loss_chunk(shape)
    packed = shape in PACKED and not split_switches(name)[0].endswith("_causal")
    out: dict = {"variant": name, "shape": shape, "batch": batch, "seq": seq, "packed": packed,
                 "activation_checkpointing": uses_ac(name)}
    if name.startswith("pgs_"):
        out["loss_chunk"] = loss_chunk
        if _slabs(name):
            out["tied_slabs"] = SLAB_ROWS[shape]
        if _tiled(name):
            out["mlp_tiles"] = args.mlp_tiles
        out["predicted_peak_gib"] = predicted_peak_gib(name, table, batch, seq, loss_chunk, SLAB_ROWS[shape],
                                                       args.mlp_tiles, defers(name, args))
        out["defer_head_grad"] = defers(name, args)
    model = opt = step = None
    cuda = device.type == "cuda"
    restore_switches = apply_switches(split_switches(name)[1])
    try:
        model = build(table, device, split_name(name)[1])
        out["attn_implementation"] = split_name(name)[1]
        out["params"] = sum(p.numel() for p in model.parameters())
        step, opt = variant_setup(name, model, args, loss_chunk, SLAB_ROWS[shape])
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        loss = None
        for _ in range(args.warmup):
            loss = step(*make_batch(vocab, batch, seq, device, packed, gen))
        gc.collect()
        gc.freeze()  # as pgs's training loop after its first step (train.freeze_gc), for every variant
        if cuda:
            torch.cuda.synchronize()
            out["peak_with_warmup_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        data = [make_batch(vocab, batch, seq, device, packed, gen) for _ in range(args.steps)]
        t0 = time.perf_counter()
        for ids, pos in data:
            loss = step(ids, pos)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        tokens = batch * seq * args.steps
        out["tok_s"] = tokens / elapsed
        out["step_s"] = elapsed / args.steps
        out["mfu"] = flops_per_token(model, seq) * out["tok_s"] / H200_BF16_FLOPS
        out["loss"] = float(loss)
        if args.profile and cuda:
            out["profile"] = profile_steps(step, data[: args.profile], f"{shape} {name}", opt)
        if args.host_timers:
            out["host_ms_per_step"] = host_timed_steps(step, data[: args.host_timers], cuda, opt)
        if args.spy:
            out["spy"] = spy_steps(step, data, f"{args.spy}.{name.replace('+', '_')}.txt", cuda)
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if not math.isfinite(out["loss"]):
            out["warning"] = "non-finite loss"
        if hasattr(opt, "fused_group_steps"):
            out["fused_group_steps"], out["plain_group_steps"] = opt.fused_group_steps, opt.plain_group_steps
    except torch.OutOfMemoryError as err:
        out["error"] = f"OOM: {str(err).splitlines()[0]}"
    except Exception as err:  # noqa: BLE001 - a bench reports every failure and goes on
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc(limit=6)
    finally:
        restore_switches()
        del model, opt, step
        gc.unfreeze()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass
    return out


def _hot_functions(opt) -> list:
    """(owner, attribute, label) of the runtime functions whose host time the bench reports."""
    from pgs.runtime.model import layers
    from pgs.runtime.optim import release
    from pgs.runtime.optim import tied_slabs as release_slabs
    from pgs.runtime.model.layers import OffloadedInput

    arrivals = getattr(opt, "_arrivals", None)  # the release's hook target is bound at construction
    return [(arrivals, "on_complete", "release group step (incl. tied slabs)"),
            (release.GradientRelease, "_fused_call", "fused update call"),
            (release_slabs.TiedSlabs, "step", "tied slabs step"),
            (OffloadedInput, "__init__", "offload to host"),
            (OffloadedInput, "get", "offload: get back"),
            (OffloadedInput, "prefetch", "offload: prefetch"),
            (layers, "_checkpoint_call", "checkpointed call (forward)")]


def _patch(opt, wrap) -> Callable[[], None]:
    """Wrap every hot function with ``wrap(fn, label)``; returns the undo."""
    undo = []
    for owner, attr, label in _hot_functions(opt):
        if owner is None or not hasattr(owner, attr):
            continue
        own = attr in vars(owner)
        fn = getattr(owner, attr) if not own else vars(owner)[attr]
        setattr(owner, attr, wrap(fn, label))
        undo.append((owner, attr, fn, own))

    def restore():
        for owner, attr, fn, own in reversed(undo):
            if own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
    return restore


def host_timed_steps(step, data, cuda: bool = True, opt=None) -> dict:
    """Host (CPU) milliseconds per step spent inside the runtime's hot functions, measured with
    ``perf_counter`` around each call (no profiler: its per-op overhead distorts a host-bound
    step).  Backward runs these on the autograd thread; nested entries count in both.  (Torch's
    own functions are not wrapped: patching them changes what Dynamo guards on and recompiles
    the layers.)  ``wall`` is the step's wall time,
    ``step_host`` the time until ``step`` returned (host ahead of the device when smaller)."""
    import collections

    acc: dict = collections.defaultdict(float)
    calls: dict = collections.defaultdict(int)

    def timed(fn, label):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
                calls[label] += 1
        return wrapper

    restore = _patch(opt, timed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        sync()
        t0 = time.perf_counter()
        returned = 0.0
        for ids, pos in data:
            t = time.perf_counter()
            step(ids, pos)
            returned += time.perf_counter() - t
        sync()
        wall = time.perf_counter() - t0
    finally:
        restore()
    n = len(data)
    out = {"wall": 1e3 * wall / n, "step_host": 1e3 * returned / n}
    out.update({k: round(1e3 * v / n, 3) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])})
    out["calls_per_step"] = {k: v / n for k, v in calls.items()}
    return out


def spy_steps(step, data, path: str, cuda: bool = True) -> dict:
    """Steady-state steps sampled by py-spy attached to this process (all threads, raw
    collapsed stacks to ``path``; bench/spy_summary.py reads them): compilation and
    warm-up stay out of the samples."""
    import signal
    import subprocess

    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "-r", "250", "--nonblocking", "--threads",
           "-f", "raw", "-o", path]
    try:
        spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as err:
        return {"error": f"py-spy: {err}"}
    time.sleep(2.0)
    if spy.poll() is not None:
        return {"error": f"py-spy exited {spy.returncode}: {spy.stdout.read()[-300:]}"}
    t0 = time.perf_counter()
    for ids, pos in data:
        step(ids, pos)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()
    return {"path": path, "steps": len(data), "ms_per_step": 1e3 * wall / len(data)}


def profile_steps(step, data, title: str, opt=None) -> dict:
    """A torch.profiler trace of ``len(data)`` steps, summarised by bench/trace_summary.py
    (wall vs CUDA busy per step, GPU time and idle time by annotation, launches, syncs)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_summary import print_summary, summarize_trace

    def annotated(fn, label):  # GPU idle time is then attributed to the phase that launched late
        name = "probe." + label

        def wrapper(*a, **k):
            with torch.profiler.record_function(name):
                return fn(*a, **k)
        return wrapper

    torch.cuda.synchronize()
    restore = _patch(opt, annotated)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for ids, pos in data:
                step(ids, pos)
            torch.cuda.synchronize()
    finally:
        restore()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    summary = summarize_trace(events, len(data))
    print_summary(title, summary)
    return summary


def run_child(name: str, shape: str, argv) -> dict:
    """``run_variant`` in a fresh process (its result read back from a temporary JSON)."""
    import subprocess
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    drop = {"--only", "--shapes", "--out"}
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a.split("=")[0] in drop:
            continue
        keep.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "one.json")
        cmd = [sys.executable, os.path.abspath(__file__), *keep, "--same-process", "--only", name,
               "--shapes", shape, "--out", out]
        env = dict(os.environ, **{SWITCHES[s][2]: _env_value(SWITCHES[s][3]) for s in split_switches(name)[1]})
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            with open(out) as f:
                return json.load(f)["results"][0]
        except (OSError, ValueError, IndexError, KeyError):
            tail = "\n".join(proc.stdout.splitlines()[-8:])
            return {"variant": name, "shape": shape, "error": f"child exited {proc.returncode}: {tail}"}


def _write(args, device, results) -> None:
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv[1:],
            "steps": args.steps, "warmup": args.warmup, "peak_flops": H200_BF16_FLOPS}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/sft_step.json")
    p.add_argument("--only", default="", help=f"comma-separated variants of {', '.join(VARIANTS)}")
    p.add_argument("--shapes", default="", help="comma-separated shapes (default: all)")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; 1 with --small)")
    p.add_argument("--loss-chunk", type=int, default=None, help="rows per loss chunk (default: per shape)")
    p.add_argument("--triton-on-cpu", action="store_true",
                   help="with --small on CPU: run the 8-bit kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    p.add_argument("--mlp-tiles", type=int, default=4, help="token slices of the _tiled variants' MLPs")
    p.add_argument("--no-defer", action="store_true",
                   help="pgs variants: the tied head's gradient accumulated chunk by chunk in the loss (a V×D "
                        "buffer through backward) instead of deferred and rebuilt at the end of backward (one "
                        "head matmul less per step; not with _slabs variants). Default: as pgs run's "
                        "memory.defer_head_grad = \"auto\" (deferred with checkpointing or slabs)")
    p.add_argument("--defer", action="store_true", help="pgs variants: always defer the tied head's gradient")
    p.add_argument("--profile", type=int, default=0,
                   help="after timing, profile this many steps (torch.profiler) and add a summary")
    p.add_argument("--host-timers", type=int, default=0,
                   help="after timing, run this many steps with perf_counter timers around the runtime's hot "
                        "functions (host ms per step by function; CUDA only)")
    p.add_argument("--spy", default="",
                   help="after timing, sample the timed steps again with py-spy attached (raw stacks to "
                        "SPY.<variant>.txt; needs py-spy on PATH)")
    p.add_argument("--same-process", action="store_true",
                   help="run every variant in this process (default: one child process per variant, so "
                        "that no variant's memory or compiled code can leak into the next one's peak)")
    p.add_argument("--compile-options", default=None,
                   help='inductor options for the compiled layers, JSON (e.g. \'{"coordinate_descent_tuning": true}\')')
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; eager on CPU with --small)")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.small else 8)
    args.warmup = args.warmup or (1 if args.small else 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.small and device.type == "cpu" and args.compile_backend is None:
        args.compile_backend = "eager"
    only = [v for v in args.only.split(",") if v]
    unknown = [v for v in only if split_switches(v)[0] not in VARIANTS
               or not set(split_switches(v)[1]) <= set(SWITCHES)]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}, each with any of the switches "
                f"{', '.join('+' + k for k in SWITCHES)}")
    shapes_table = SMALL_SHAPES if args.small else SHAPES
    shapes = [s for s in args.shapes.split(",") if s] or list(shapes_table)
    results = []
    for shape in shapes:
        if shape not in shapes_table:
            p.error(f"unknown shape {shape!r}; choose from {', '.join(shapes_table)}")
        for name in only or SHAPE_VARIANTS[shape]:
            r = run_variant(name, shape, args, device) if args.same_process else run_child(name, shape, argv)
            results.append(r)
            summary = r.get("error") or (f"{r['tok_s']:.0f} tok/s, MFU {r['mfu']:.3f}, "
                                         f"peak {r.get('peak_gib', float('nan')):.2f} GiB, loss {r['loss']:.3f}")
            pred = r.get("predicted_peak_gib")
            if pred is not None and "error" not in r:
                summary += f", predicted {pred:.2f} GiB"
            print(f"{shape:>11} {name:<20} {summary}", flush=True)
            _write(args, device, results)  # after every variant: a later crash or timeout loses nothing
    _write(args, device, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
