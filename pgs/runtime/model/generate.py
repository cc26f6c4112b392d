"""Batched sampling of completions for tokenized prompts, with a KV cache.

One generation path for the runtime: greedy task accuracy at eval
(``pgs.runtime.loop.evaluate.task_accuracy``), on-policy samples of the student in
distillation (docs/techniques/distillation.md), and completions for ``pgs prepare``.

- Prompts of different lengths are left-padded into one batch: the attention mask hides the
  padding and position ids count real tokens only, so a prompt's continuation does not depend
  on what it is batched with (up to the kernels' floating-point summation order).
- The prompt is run once (prefill), then one token per step against the KV cache.  On CUDA
  the cache is transformers' ``StaticCache`` (preallocated to prompt + ``max_new_tokens``; the
  attention mask is the cache's full width, filled as tokens arrive), the decode step is
  ``torch.compile``d once per model for every width, and each batch captures it as a CUDA graph
  of its own (:class:`_GraphedStep`); elsewhere a ``DynamicCache`` and eager steps.
  The prefill and eager steps run any ``torch.compile``d parts of the model as written
  (``force_eager``: layers compiled for training are not recompiled for generation's shapes).
- Sampling: temperature τ (τ = 0: greedy, the argmax), nucleus top-p (Holtzman et al., arXiv
  1904.09751: the smallest set of most likely tokens whose mass reaches p), and an explicit
  ``torch.Generator`` as the only source of randomness.  A token is drawn as
  argmax_v p_v / E_v with E_v ~ Exp(1) drawn from the generator (the exponential race, an
  exact sample of p, one uniform per vocabulary entry per step whatever the outcome), so the
  generator's state after a call depends on the call's shape and its number of decode steps
  only (not on which tokens won): saving ``generator.get_state()`` in a checkpoint and
  restoring it reproduces every later sample.
- A sequence stops at the first of its ``stop_ids`` (the end-of-turn ids, the stop token is
  part of the completion) or after ``max_new_tokens``; the loop ends when all have stopped.
- Several processes sampling one global batch together (:class:`Share`: distillation on N
  ranks, each its share of the prompts): every process draws the whole batch's race
  ``[total, V]`` from the same generator state and keeps the rows of its own prompts, pads to
  the batch's longest prompt, and decodes until every process's rows have stopped (a
  collective at each check).  So a prompt's completion is the one one process sampling the whole
  batch draws (up to the forward's summation order, which the batch's size may change), the
  generators stay equal on every process, and every process runs the same number of forwards
  (FSDP's all-gathers are collectives).

The model runs in eval mode under ``torch.no_grad`` and is put back as it was.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from pgs.errors import InvalidArgument
from pgs.runtime.process import collective_device


#: With a compiled decode step, prompts are left-padded to a multiple of this many tokens.
STATIC_WIDTH_MULTIPLE = 64

#: On CUDA, tokens decoded between two checks (each a wait for the device) that all rows stopped.
DONE_CHECK_EVERY = 8


@dataclass(frozen=True)
class GenerationSettings:
    """How completions are drawn.

    Attributes:
        max_new_tokens: at most this many tokens per completion (≥ 1).
        temperature: τ ≥ 0; 0 means greedy decoding.
        top_p: nucleus mass p ∈ (0, 1]; 1 keeps the whole vocabulary.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            raise InvalidArgument(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Share:
    """This process's part of a batch whose prompts are spread over processes that sample
    together (module docstring).

    Attributes:
        rows: the global index of each of this process's prompts, in the order they are passed.
        total: prompts in the global batch (the race drawn at each step is ``[total, V]``).
        width: the global batch's longest prompt; every process left-pads to it.
        all_stopped: ``all_stopped(mine) -> bool``, whether every process's rows have stopped
            given whether this one's have (a collective: every process calls it at the same
            decode steps).
    """

    rows: tuple[int, ...]
    total: int
    width: int
    all_stopped: Callable[[bool], bool]


@dataclass
class Generation:
    """What ``generate`` returns; rows follow the order of the prompts.

    Attributes:
        prompt_ids: [B, P] the prompts, left-padded with ``pad_id``.
        prompt_mask: [B, P] bool, True on prompt tokens.
        completion_ids: [B, T] the completions (T ≤ max_new_tokens), ``pad_id`` after a stop.
        completion_mask: [B, T] bool, True on generated tokens (the stop token included).
        lengths: [B] int64, the completions' lengths (completion_mask's row sums).
        generated_tokens: Σ lengths.
        seconds: wall time of the call.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    lengths: Tensor
    generated_tokens: int
    seconds: float

    def completions(self) -> list[list[int]]:
        """Each completion's token ids, without padding (the stop token kept)."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.lengths.tolist())]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device=None, multiple: int = 1,
             at_least: int = 0) -> tuple[Tensor, Tensor]:
    """``(ids [B, P], mask [B, P])``: the prompts right-aligned, ``pad_id`` before them; P is the
    longest prompt (or ``at_least``, if longer) rounded up to ``multiple``."""
    width = -(-max(at_least, *(len(p) for p in prompts)) // multiple) * multiple
    ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = True
    return ids.to(device), mask.to(device)


def next_token(logits: Tensor, settings: GenerationSettings, generator: torch.Generator | None,
               rows: Tensor | None = None, total: int = 0) -> Tensor:
    """One token per row of ``logits`` [B, V]: the argmax (τ = 0), else a sample of
    softmax(logits/τ) restricted to the top-p nucleus (exponential race, module docstring).
    ``rows`` [B] (with ``total``): the race is drawn for a batch of ``total`` rows and row
    ``rows[i]`` of it races for ``logits[i]`` (:class:`Share`)."""
    if settings.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    if settings.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep a token if the mass before it is below p (the most likely one always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= settings.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    if rows is None:
        race = torch.empty_like(probs).exponential_(generator=generator)
    else:
        whole = torch.empty((total, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
        race = whole.exponential_(generator=generator)[rows]
    return (probs / race).argmax(-1)


def _use_static(model, cache: str) -> bool:
    if cache not in ("auto", "static", "dynamic"):
        raise InvalidArgument(f"cache must be 'auto', 'static' or 'dynamic', got {cache!r}")
    if cache == "auto":
        return next(model.parameters()).is_cuda
    return cache == "static"


def _make_cache(model, static: bool, max_len: int):
    from transformers import DynamicCache, StaticCache

    config = model.config
    if static:
        return StaticCache(config=config, max_cache_len=max_len)
    return DynamicCache(config=config)


def cache_keyword(model) -> str:
    """The name under which ``model``'s forward takes the KV cache: ``cache`` in transformers
    releases that renamed it, ``past_key_values`` before (an unknown keyword would be swallowed
    by the forward's ``**kwargs`` and the cache silently left empty)."""
    name = getattr(model, "_pgs_cache_keyword", None)
    if name is None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model._pgs_cache_keyword = name
    return name


def _step(model, ids: Tensor, mask: Tensor, pos: Tensor, cache, keyword: str) -> Tensor:
    """Last-position logits [B, V] (fp32) of one forward with the cache (``keyword``: its name)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{keyword: cache})
    return out.logits[:, -1].float()


def _eager():
    """The prefill and uncompiled decode steps run the model's code as written: decoder layers
    that ``memory.compile_layers`` compiled for training would otherwise recompile here for
    every prompt width and, with a cache, once per layer (each layer's cache index is a
    constant of its graph), until dynamo's recompile limit."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _compiled_step(model):
    """``_step`` compiled once per model (inductor; the CUDA graph is :class:`_GraphedStep`'s).

    ``dynamic=None``: the first call at a second cache width recompiles with the width symbolic
    (dynamo's automatic dynamic shapes), and every later width reuses that graph.  With the shapes
    fixed, each prompt width (padded to ``STATIC_WIDTH_MULTIPLE``) compiled anew until dynamo's
    recompile limit (8), past which every new width ran uncompiled: real prompts of varying length
    reach it within a few distillation steps."""
    fn = getattr(model, "_pgs_decode_step", None)
    if fn is None:
        fn = torch.compile(_step, dynamic=None)
        model._pgs_decode_step = fn
    return fn


#: per model: its last decode graph (whose memory pool the next capture reuses), and the models
#: whose decode step could not be captured (weak: they go with their models)
_LAST_GRAPH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NO_GRAPH: "weakref.WeakSet" = weakref.WeakSet()


class _GraphedStep:
    """The compiled decode step of one batch as a CUDA graph, captured for that batch only.

    The first call runs the compiled function on the capture stream (compiling it if this width
    or batch is new to it, and warming up its kernels) with this object's token and position
    buffers; the second captures the same call into a ``torch.cuda.CUDAGraph`` and replays it;
    later calls copy the new token and positions into the buffers and replay.  Its inputs keep
    their addresses for the batch's life (the buffers, the batch's attention mask, filled in place
    as tokens arrive, and its KV cache), and the logits it returns are the graph's output,
    overwritten by the next replay (after ``next_token`` has read them).  The graph and its
    memory pool go with the object at the end of the batch, but for the pool: every capture of a
    model goes into the one pool of its previous capture (the last graph, kept per model, holds
    it; it is never replayed again), so the blocks one batch's graph freed serve the next one's.  A
    new pool per capture would leave each old one reserved until the allocator runs short.

    Why not ``torch.compile(mode="reduce-overhead")``: its CUDA graphs live in a process-wide
    tree keyed by input addresses, and a new KV cache per call made it record a new graph on
    every call and keep the old ones, each checked at every later step.

    If the capture fails (an operation in the step that a graph cannot hold), the batch goes on
    with the compiled function uncaptured, and so do the model's later batches, with a warning."""

    def __init__(self, fn, model, mask: Tensor, cache, keyword: str):
        self.fn, self.model, self.mask, self.cache, self.keyword = fn, model, mask, cache, keyword
        self.stream = torch.cuda.Stream(mask.device)
        self.tok = self.last = self.out = self.graph = None

    def _call(self) -> Tensor:
        return self.fn(self.model, self.tok, self.mask, self.last, self.cache, self.keyword)

    def __call__(self, tok: Tensor, last: Tensor) -> Tensor:
        if self.graph is not None:
            self.tok.copy_(tok)
            self.last.copy_(last)
            self.graph.replay()
            return self.out
        current = torch.cuda.current_stream(self.mask.device)
        if self.tok is None or self.model in _NO_GRAPH:
            self.tok, self.last = tok.clone(), last.clone()
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):  # warm-up off the default stream, as capture wants
                out = self._call()
            current.wait_stream(self.stream)
            return out
        self.tok.copy_(tok)
        self.last.copy_(last)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        previous = _LAST_GRAPH.get(self.model)
        try:
            # thread_local: CUDA calls of other threads (background checkpoint copies, the loader's
            # pinned batches) do not invalidate this capture
            with torch.cuda.graph(graph, pool=None if previous is None else previous.pool(), stream=self.stream,
                                  capture_error_mode="thread_local"):
                out = self._call()
        except RuntimeError as err:
            _NO_GRAPH.add(self.model)
            warnings.warn(f"generate: the decode step could not be captured as a CUDA graph "
                          f"({str(err).splitlines()[0]}); it runs compiled, without a graph", stacklevel=3)
            current.synchronize()
            return self(tok, last)
        self.graph, self.out = graph, out
        _LAST_GRAPH[self.model] = graph  # keeps the pool (not the cache) for the next batch's capture
        graph.replay()
        return out


def _all_done(done: Tensor, synced: bool) -> bool:
    """Whether the batch has stopped; ``synced``: whether every rank's batch has (a MAX
    all-reduce of "still running", on the collective's device), the same answer on every rank."""
    if not synced:
        return bool(done.all())
    running = (~done).any().to(device=collective_device(), dtype=torch.int64).reshape(1)
    dist.all_reduce(running, op=dist.ReduceOp.MAX)
    return not bool(running.item())


@torch.no_grad()
def _generate_batch(model, prompts, settings, stop_ids, pad_id, generator, static, compile_step,
                    share: Share | None = None, synced: bool = False):
    device = next(model.parameters()).device
    rows = None
    mine = len(prompts)
    if share is not None:
        # a process without prompts decodes one stopped placeholder row: its forwards keep pace
        prompts = list(prompts) or [[int(pad_id)]]
        rows = torch.as_tensor(list(share.rows) or [0], dtype=torch.long, device=device)
    # widths in multiples of 64 for the compiled step (aligned shapes; after its second width it takes any)
    ids, pmask = left_pad(prompts, pad_id, device, STATIC_WIDTH_MULTIPLE if compile_step else 1,
                          at_least=share.width if share is not None else 0)
    B, P = ids.shape
    T = settings.max_new_tokens
    width = P + T
    cache = _make_cache(model, static, width)
    mask = torch.zeros((B, width), dtype=torch.long, device=device)
    mask[:, :P] = pmask
    pos = (pmask.long().cumsum(-1) - 1).masked_fill_(~pmask, 1)  # pad rows' positions are masked anyway
    stops = torch.as_tensor(sorted(set(int(s) for s in stop_ids)), dtype=torch.long, device=device)
    out = torch.full((B, T), int(pad_id), dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    if mine < B:
        done[mine:] = True  # the placeholder row of a process without prompts
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    keyword = cache_keyword(model)
    with _eager():
        logits = _step(model, ids, mask if static else mask[:, :P], pos, cache, keyword)
    last = pos[:, -1:]
    compiled = _compiled_step(model) if compile_step else None
    graphed = _GraphedStep(compiled, model, mask, cache, keyword) if (
        compiled is not None and static and device.type == "cuda") else None
    check_every = DONE_CHECK_EVERY if device.type == "cuda" else 1
    stopped = (lambda: _all_done(done, synced)) if share is None else (lambda: share.all_stopped(bool(done.all())))
    for t in range(T):
        tok = next_token(logits, settings, generator, rows, share.total if share is not None else 0)
        tok = torch.where(done, torch.full_like(tok, int(pad_id)), tok)
        out[:, t] = tok
        lengths += (~done).long()
        if stops.numel():
            done |= torch.isin(tok, stops)
        if t == T - 1 or ((t + 1) % check_every == 0 and stopped()):
            break
        mask[:, P + t] = 1
        last = last + 1
        seen = mask if static else mask[:, : P + t + 1]
        if graphed is not None:
            logits = graphed(tok[:, None], last)
        elif compiled is not None:
            logits = compiled(model, tok[:, None], seen, last, cache, keyword)
        else:
            with _eager():
                logits = _step(model, tok[:, None], seen, last, cache, keyword)
    ids, pmask, out, lengths = ids[:mine], pmask[:mine], out[:mine], lengths[:mine]
    used = int(lengths.max()) if mine else 0  # the tokens decoded after the last row stopped are padding
    out = out[:, :used]
    cmask = torch.arange(used, device=device)[None, :] < lengths[:, None]
    return ids, pmask, out, cmask, lengths


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    settings: GenerationSettings,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    cache: str = "auto",
    compile: bool | None = None,
    share: Share | None = None,
    synced: bool = False,
) -> Generation:
    """Completions of ``prompts`` (lists of token ids) by ``model`` (a transformers causal LM).

    Args:
        model: the causal LM; run in eval mode without gradients, then put back.
        prompts: token ids per prompt (each non-empty).
        settings: ``GenerationSettings`` (max_new_tokens, temperature, top_p).
        stop_ids: the ids that end a completion (the end-of-turn ids; the tokenizer's eos).
        pad_id: fills left padding and the tail after a stop.
        generator: the sampler's ``torch.Generator`` on the model's device (required unless
            greedy); its state is advanced and is the only randomness used.
        batch_size: prompts per forward (all at once by default); the output is the same.
        cache: ``"auto"`` (static on CUDA, dynamic elsewhere), ``"static"`` or ``"dynamic"``.
        compile: compile the decode step (default: with a static cache on CUDA).
        share: this process's part of a batch sampled over several processes (:class:`Share`;
            one batch, ``batch_size`` unset; ``prompts`` may then be empty).
        synced: several processes share the model (FSDP2: each forward all-gathers the
            sharded parameters) and every rank calls ``generate`` at the same time with the
            same number of batches: a batch decodes until every rank's batch has stopped (one
            all-reduce per check), so every rank makes the same forwards.  The completions are
            what they would be alone (tokens after a row's stop are padding either way).  The
            decode step then runs uncompiled (FSDP2 gathers the parameters in its forward hooks,
            which a compiled step's CUDA graph would not replay).

    Returns:
        ``Generation``; the completions of all batches padded to the longest.
    """
    if not prompts and share is None:
        raise InvalidArgument("prompts: nothing to generate from (an empty list)")
    if share is not None and (batch_size is not None or len(share.rows) != len(prompts)):
        raise InvalidArgument(f"share: {len(share.rows)} rows for {len(prompts)} prompts, in one batch "
                              "(batch_size unset)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InvalidArgument(f"prompts[{i}] is empty (a prompt needs at least one token)")
    if not settings.greedy and generator is None:
        raise InvalidArgument("generator: sampling (temperature > 0) needs an explicit torch.Generator")
    static = _use_static(model, cache)
    compile_step = static and next(model.parameters()).is_cuda if compile is None else bool(compile)
    # a sharded model's forward gathers its parameters in FSDP2's hooks, which neither a compiled
    # decode step nor its CUDA graph's replay would run
    compile_step = compile_step and not synced
    size = max(len(prompts), 1) if batch_size is None else int(batch_size)
    if size < 1:
        raise InvalidArgument(f"batch_size must be a positive integer, got {batch_size!r}")
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    parts = []
    try:
        for b in range(0, max(len(prompts), 1), size):
            parts.append(_generate_batch(model, prompts[b : b + size], settings, stop_ids, pad_id, generator,
                                         static, compile_step, share, synced))
    finally:
        model.train(was_training)
    P = max(p[0].shape[1] for p in parts)
    T = max(p[2].shape[1] for p in parts)

    def pad_left(t: Tensor, fill) -> Tensor:
        return torch.nn.functional.pad(t, (P - t.shape[1], 0), value=fill)

    def pad_right(t: Tensor, fill) -> Tensor:
        return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=fill)

    prompt_ids = torch.cat([pad_left(p[0], int(pad_id)) for p in parts])
    prompt_mask = torch.cat([pad_left(p[1], False) for p in parts])
    completion_ids = torch.cat([pad_right(p[2], int(pad_id)) for p in parts])
    completion_mask = torch.cat([pad_right(p[3], False) for p in parts])
    lengths = torch.cat([p[4] for p in parts])
    total = int(lengths.sum())
    if completion_ids.is_cuda:
        torch.cuda.synchronize(completion_ids.device)
    return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths, total,
                      time.perf_counter() - start)
