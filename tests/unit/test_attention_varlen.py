"""``attn_implementation = "varlen"``: packed documents attend only to themselves, with the
same numbers as transformers' own block-diagonal SDPA path (CPU reference path here; the CUDA
kernel against that reference in the CUDA-marked test)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from pgs.errors import SpecError
from pgs.runtime.model import attention as A
from pgs.runtime.data import Document, collate, packing_isolation
from pgs.runtime.documents import cu_seqlens
from pgs.runtime.model.build import build_model, final_hidden
from tiny import tiny_config, tiny_model

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)


def tiny(kind: str, attn: str, dtype=torch.float32):
    attn = A.hf_implementation(attn)
    kind, head_dim = ("qwen3", 8) if kind == "qwen3" else ("llama", None)
    return tiny_model(kind, seed=0, dtype=dtype, mode=None, head_dim=head_dim, max_position_embeddings=64,
                      attn_implementation=attn)


def batch_of(lengths_per_row, seq_len, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = [[Document(tuple(torch.randint(1, 96, (n,), generator=g).tolist()), (True,) * n) for n in row]
            for row in lengths_per_row]
    return rows, collate(rows, pad_id=0, seq_len=seq_len)


def test_boundaries_from_positions_match_the_collated_ones():
    _, batch = batch_of([(7, 5, 9), (5, 9), (24,)], seq_len=24)
    cu = cu_seqlens(batch.position_ids)
    expected = [0]
    for r, row_cu in enumerate(batch.cu_seqlens):
        base = r * 24
        expected += [base + int(b) for b in row_cu[1:]]
        # padding: the run of padding at the end of a row is one document
        if int(row_cu[-1]) < 24:
            expected.append(base + 24)
    assert cu.dtype == torch.int32
    assert cu.tolist() == expected


def test_a_row_that_starts_mid_document_still_starts_a_document():
    pos = torch.tensor([[3, 4, 5, 0, 1], [0, 1, 2, 3, 4]])
    assert cu_seqlens(pos).tolist() == [0, 3, 5, 10]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_varlen_equals_sdpa_forward_and_backward(kind):
    _, batch = batch_of([(7, 5, 9), (5, 9)], seq_len=24)
    outs, grads = [], []
    for attn in ("sdpa", "varlen"):
        model = tiny(kind, attn).train()
        h = final_hidden(model, batch.input_ids, batch.position_ids)
        (h.float().square().mean()).backward()
        outs.append(h.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_document_logits_equal_alone_with_varlen(kind):
    model = tiny(kind, "varlen").eval()
    assert packing_isolation(model).isolates
    rows, batch = batch_of([(7, 5, 9), (5, 9)], seq_len=24)
    with torch.no_grad():
        # the model's own forward (no boundaries handed in: derived from position_ids)
        packed = model(**batch.forward_kwargs()).logits
        for row, row_docs in enumerate(rows):
            bounds = batch.cu_seqlens[row].tolist()
            for d, start, stop in zip(row_docs, bounds, bounds[1:]):
                alone = model(input_ids=torch.tensor([d.input_ids]), use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, start:stop], alone, atol=1e-5, rtol=1e-5)


def test_without_positions_each_row_is_one_causal_sequence():
    model_v, model_s = tiny("qwen3", "varlen").eval(), tiny("qwen3", "sdpa").eval()
    ids = torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model_v(input_ids=ids, use_cache=False).logits,
                                   model_s(input_ids=ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_step_equals_transformers_sdpa_with_copied_heads(hq, hkv, masked):
    """One new token per row against a cache: the grouped heads read in place give what
    transformers' SDPA function gives after copying every key/value head (``repeat_kv``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(5)
    B, W, D = 3, 11, 16
    q = torch.randn(B, hq, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, W, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:  # left padding of 0, 4 and 7 positions, and the cache's unfilled tail
        keep = torch.ones(B, W, dtype=torch.bool)
        keep[1, :4], keep[2, :7], keep[:, 9:] = False, False, False
        mask = keep[:, None, None, :]
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, none = A.varlen_attention(module, q, k, v, mask, scaling=0.3)
    assert none is None and got.shape == want.shape == (B, 1, hq, D)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_cached_generation_with_varlen_equals_sdpa(device):
    """Greedy completions through the decode path (static and dynamic caches, left-padded
    prompts, grouped heads; on CUDA the static cache's decode step is compiled and replayed as
    a CUDA graph) are transformers' SDPA model's."""
    from pgs.runtime.model.generate import GenerationSettings, generate

    config = dict(model_type="qwen3", head_dim=8, **{**TINY, "num_attention_heads": 8, "num_key_value_heads": 2})
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 9, 6)]
    settings = GenerationSettings(max_new_tokens=12, temperature=0)
    outs = {}
    for attn in ("sdpa", "varlen"):
        model = build_model(config=config, attn_implementation=attn, init_seed=2, device=device)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)  # no near-ties in the greedy choices
        for cache in ("static", "dynamic"):
            outs[attn, cache] = generate(model, prompts, settings, stop_ids=[], pad_id=0, cache=cache).completion_ids
    for cache in ("static", "dynamic"):
        assert torch.equal(outs["varlen", cache], outs["sdpa", cache]), cache


def test_build_model_registers_the_implementation():
    model = build_model(config=dict(model_type="qwen3", head_dim=8, **TINY), attn_implementation="varlen")
    assert model.config._attn_implementation == A.HF_NAME
    assert A.uses_varlen(model)


def test_dropout_and_sliding_windows_are_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(SpecError, match="dropout"):
        A.varlen_attention(None, q, q, q, None, dropout=0.1)
    with pytest.raises(SpecError, match="sliding-window"):
        A.varlen_attention(None, q, q, q, None, sliding_window=16)


def test_the_spec_accepts_varlen():
    from pgs.runtime.spec.load import ModelSpec

    assert ModelSpec(config={"model_type": "qwen3"}, attn_implementation="varlen").attn_implementation == "varlen"
    with pytest.raises(Exception, match="attn_implementation"):
        ModelSpec(config={"model_type": "qwen3"}, attn_implementation="varlenn")


@pytest.mark.skipif(not A.varlen_available("cuda", torch.bfloat16), reason="needs CUDA and torch's varlen_attn")
def test_cuda_kernel_equals_the_reference_path():
    torch.manual_seed(0)
    _, batch = batch_of([(300, 500, 224), (1024,)], seq_len=1024)
    cu = cu_seqlens(batch.position_ids).cuda()
    q = torch.randn(2 * 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2 * 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2 * 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn, causal = A._varlen_call()
    out = fn(q, k, v, cu, cu, 1024, 1024, scale=None, **causal)
    ref = A._reference(q.float(), k.float(), v.float(), cu, 2, 1024, None)
    _assert_bf16_close(out, ref, (q, k, v))


def _assert_bf16_close(out, ref, inputs) -> None:
    """A bf16 kernel's output and its gradients (for a random output gradient) against the fp32
    reference's."""
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, go)
    want = torch.autograd.grad(ref, inputs, go.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


def test_generation_with_padding_and_cache_equals_sdpa():
    """Not a packed forward (left padding, then a cache): transformers' SDPA path, same tokens."""
    prompts = [[5, 9, 17, 33, 2, 8], [41, 3, 7]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    outs = []
    for attn in ("sdpa", "varlen"):
        model = tiny("qwen3", attn).eval()
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_training_forward_builds_no_mask():
    """A packed training forward hands the kernel no [B, 1, S, S] mask."""
    seen = []
    real = A.varlen_attention

    def spy(module, q, k, v, attention_mask, **kw):
        seen.append(attention_mask)
        return real(module, q, k, v, attention_mask, **kw)

    from transformers import AttentionInterface

    model = tiny("qwen3", "varlen").train()
    AttentionInterface.register(A.HF_NAME, spy)
    try:
        _, batch = batch_of([(7, 5, 9), (5, 9)], seq_len=24)
        final_hidden(model, batch.input_ids, batch.position_ids)
    finally:
        A.register()
    assert seen and all(m is None for m in seen)


def test_auto_picks_varlen_only_where_it_runs_and_suits(monkeypatch):
    plain = tiny_config(max_position_embeddings=64)
    sliding = tiny_config(max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                          use_sliding_window=True, sliding_window=8)
    dropout = tiny_config(max_position_embeddings=64, attention_dropout=0.1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert A.hf_implementation("auto", plain) == "sdpa"  # no CUDA: transformers' SDPA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if A._varlen_call() is not None:
        assert A.hf_implementation("auto", plain) == A.HF_NAME
    assert A.hf_implementation("auto", sliding) == "sdpa"
    assert A.hf_implementation("auto", dropout) == "sdpa"
    assert "layer_types" in A.varlen_suits(sliding) and "dropout" in A.varlen_suits(dropout)
    assert A.varlen_suits(plain) is None
    assert A.hf_implementation("eager", plain) == "eager"


def test_build_model_auto_on_cpu_is_sdpa():
    model = build_model(config=dict(model_type="qwen3", head_dim=8, **TINY))
    expected = A.HF_NAME if (torch.cuda.is_available() and A._varlen_call() is not None) else "sdpa"
    assert model.config._attn_implementation == expected


def test_the_spec_resolves_defer_head_grad():
    from pgs.runtime.spec.load import MemorySpec

    assert MemorySpec().defer_head_grad == "auto" and not MemorySpec().head_grad_deferred()
    assert MemorySpec(activation_checkpointing="full").head_grad_deferred()
    assert MemorySpec(tied_slabs=4096).head_grad_deferred()
    assert not MemorySpec(activation_checkpointing="full", defer_head_grad=False).head_grad_deferred()
    assert MemorySpec(defer_head_grad=True).head_grad_deferred()
    with pytest.raises(SpecError, match="defer_head_grad"):
        MemorySpec(defer_head_grad="yes")


@pytest.mark.skipif(not A.varlen_available("cuda", torch.bfloat16), reason="needs CUDA and torch's varlen_attn")
def test_one_document_per_row_takes_dense_sdpa(monkeypatch):
    """Unpacked rows (one document each) run as dense causal SDPA, rows of several documents on
    the varlen kernel; both equal the reference."""
    torch.manual_seed(0)
    calls = []
    dense = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or dense(*a, **k))
    for docs in ([(1024,), (1024,)], [(300, 724), (1024,)]):
        _, batch = batch_of(docs, seq_len=1024)
        pos = batch.position_ids.cuda()
        q = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _ = A.varlen_attention(None, q, k, v, None, **A.packed_kwargs(pos))
        assert len(calls) == (1 if len(docs[0]) == 1 else 0)
        cu = cu_seqlens(pos)
        flat = [t.transpose(1, 2).reshape(2048, t.shape[1], 128).float() for t in (q, k, v)]
        ref = A._reference(*flat, cu, 2, 1024, None).view(2, 1024, 8, 128)
        calls.clear()
        _assert_bf16_close(out, ref, (q, k, v))


# --------------------------------------------------------------- the packed kernel (model.varlen_kernel)


@pytest.fixture
def kernel_choice():
    """Restore the process-wide kernel choice after a test that changes it."""
    before = A._kernel
    yield
    A._kernel = before


@pytest.mark.parametrize("minimum", [0, 2])
@pytest.mark.parametrize("docs", [1, 2, 61, 62, 63, 64, 65, 130])
def test_pad_documents_appends_zero_length_documents_to_the_bucket(docs, minimum):
    cu = torch.cumsum(torch.randint(1, 50, (docs + 1,)), 0).to(torch.int32)
    cu[0] = 0
    padded = A.pad_documents(cu, 64, minimum)
    added = padded.numel() - 1 - docs
    assert (padded.numel() - 1) % 64 == 0
    assert minimum <= added < 64 + minimum  # the smallest bucket that holds them and the minimum
    assert torch.equal(padded[: cu.numel()], cu)  # the real boundaries untouched
    assert (padded[cu.numel():] == cu[-1]).all()  # every added document is empty
    assert padded.dtype == cu.dtype


def test_the_spec_and_the_setter_refuse_an_unknown_kernel(kernel_choice):
    from pgs.runtime.spec.load import ModelSpec

    assert ModelSpec(config={"model_type": "qwen3"}, varlen_kernel="flash").varlen_kernel == "flash"
    assert ModelSpec(config={"model_type": "qwen3"}).varlen_kernel == "auto"
    with pytest.raises(SpecError, match="varlen_kernel"):
        ModelSpec(config={"model_type": "qwen3"}, varlen_kernel="fa3")
    with pytest.raises(SpecError, match="model.varlen_kernel"):
        A.set_varlen_kernel("fa3")


def test_the_spec_knows_the_same_kernels_as_the_attention_module():
    from pgs.runtime.spec import sections

    assert sections.VARLEN_KERNELS == A.VARLEN_KERNELS


def test_cudnn_without_the_frontend_is_refused_where_cuda_is(monkeypatch, kernel_choice):
    monkeypatch.setattr(A, "_cudnn_thd", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SpecError, match="nvidia-cudnn-frontend"):
        A.set_varlen_kernel("cudnn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    A.set_varlen_kernel("cudnn")  # no CUDA: the reference path runs whatever the choice
    assert A._kernel == "cudnn"


@pytest.mark.parametrize("choice, frontend, capability, expected", [
    ("auto", True, (9, 0), "cudnn"), ("auto", True, (8, 0), "flash"), ("auto", True, (10, 0), "flash"),
    ("auto", False, (9, 0), "flash"), ("flash", True, (9, 0), "flash"), ("cudnn", True, (8, 0), "cudnn"),
])
def test_the_kernel_resolves_per_choice_frontend_and_device(monkeypatch, kernel_choice, choice, frontend,
                                                            capability, expected):
    monkeypatch.setattr(A, "_cudnn_thd", (lambda: object()) if frontend else (lambda: None))
    monkeypatch.setattr(A, "_cudnn_probe", lambda index: None)  # the first use passes
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(A, "_resolved", {})
    A._kernel = choice
    assert A._resolve(7) == expected
    assert A._resolved == {(choice, 7): expected}  # what the compiled layers read


def test_build_model_sets_the_kernel_choice(kernel_choice):
    build_model(config=dict(model_type="qwen3", head_dim=8, **TINY), varlen_kernel="flash")
    assert A._kernel == "flash"
    with pytest.raises(SpecError, match="varlen_kernel"):
        build_model(config=dict(model_type="qwen3", head_dim=8, **TINY), varlen_kernel="nope")


_CUDNN = A.varlen_available("cuda", torch.bfloat16) and A._cudnn_thd() is not None


@pytest.mark.skipif(not _CUDNN, reason="needs CUDA, torch's varlen_attn and nvidia-cudnn-frontend")
@pytest.mark.parametrize("docs", [[(300, 500, 224), (1024,)], [(100,) * 10 + (24,), (512, 512)]])
def test_cuda_cudnn_kernel_equals_the_reference_path(docs):
    """cuDNN's THD kernel (document count padded to its bucket) against the fp32 reference."""
    torch.manual_seed(0)
    _, batch = batch_of(docs, seq_len=1024)
    cu = cu_seqlens(batch.position_ids).cuda()
    q = torch.randn(2 * 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2 * 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2 * 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = A._cudnn_varlen(q, k, v, cu, 1024, None)
    ref = A._reference(q.float(), k.float(), v.float(), cu, 2, 1024, None)
    _assert_bf16_close(out, ref, (q, k, v))


@pytest.mark.skipif(not _CUDNN, reason="needs CUDA, torch's varlen_attn and nvidia-cudnn-frontend")
def test_cuda_the_chosen_kernel_runs(monkeypatch, kernel_choice):
    """Packed rows go to cuDNN under "cudnn" (and "auto" on compute capability 9.0), to
    FlashAttention-2 under "flash"; both equal the reference."""
    torch.manual_seed(0)
    calls = []
    real = A._cudnn_varlen
    monkeypatch.setattr(A, "_cudnn_varlen", lambda *a: calls.append(1) or real(*a))
    _, batch = batch_of([(300, 724), (1024,)], seq_len=1024)
    pos = batch.position_ids.cuda()
    cu = cu_seqlens(pos)
    auto_cudnn = torch.cuda.get_device_capability() in A.CUDNN_AUTO_CAPABILITIES
    for choice, expect in (("cudnn", 1), ("flash", 0), ("auto", int(auto_cudnn))):
        A.set_varlen_kernel(choice)
        calls.clear()  # the first resolution's probe calls the kernel too
        q = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _ = A.varlen_attention(None, q, k, v, None, **A.packed_kwargs(pos))
        assert len(calls) == expect, choice
        calls.clear()
        flat = [t.transpose(1, 2).reshape(2048, t.shape[1], 128).float() for t in (q, k, v)]
        ref = A._reference(*flat, cu, 2, 1024, None).view(2, 1024, 8, 128)
        _assert_bf16_close(out, ref, (q, k, v))


def test_padding_inside_a_compiled_layer_does_not_recompile_per_count():
    """With ``minimum=2`` the padded count takes one compiled graph whatever a step's count
    (dynamo specialises sizes 0 and 1: with ``minimum=0`` a count one short of a bucket, or on
    it, recompiles; measured as a 3.8× slower 0.6B run, docs/performance.md)."""
    from torch._dynamo.utils import counters

    def layer(x, cu):
        padded = A.pad_documents(cu, 64, minimum=2)
        return x * padded.shape[0] + padded[-1]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager", dynamic=None)
    x = torch.ones(4)
    for docs in (30, 63, 64, 65, 62, 127, 128):
        cu = torch.arange(docs + 1, dtype=torch.int32)
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        out = compiled(x, cu)
        assert torch.equal(out, layer(x, cu))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


# ------------------------------------- the packed kernel never crashes a run (issue 19): load, probe, fall back


def test_the_frontend_modules_it_needs_are_imported_eagerly():
    """The backward's lazily imported packed-LSE module is among those loaded up front."""
    assert "cudnn.sdpa.packed_lse" in A.CUDNN_MODULES and "cudnn.sdpa.fwd.torch_op" in A.CUDNN_MODULES
    assert set(A.CUDNN_OPS) == {"sdpa_fwd", "sdpa_bwd", "_packed_lse_to_padded"}


def _fake_frontend(monkeypatch, broken: str | None = None):
    """A stand-in ``cudnn`` package in sys.modules (its SDPA modules importable, ``broken`` not)."""
    import importlib.machinery

    op = object()
    names = ["cudnn", "cudnn.sdpa", "cudnn.sdpa.fwd", *A.CUDNN_MODULES]
    for name in names:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["cudnn"].sdpa_torch = op
    if broken is not None:
        monkeypatch.setitem(sys.modules, broken, None)  # importing it raises ImportError
    monkeypatch.setattr(A, "_cudnn_fn", None)
    return op


def test_the_loader_imports_every_module_and_checks_the_ops(monkeypatch):
    op = _fake_frontend(monkeypatch)
    monkeypatch.setattr(A, "CUDNN_OPS", ("sdpa_fwd", "_pgs_no_such_op"))  # one op that no import registers
    fn, installed, why = A._cudnn_load.__wrapped__()
    assert fn is None and installed
    assert why.startswith("its import registered no torch.ops.cudnn.") and "_pgs_no_such_op" in why
    monkeypatch.setattr(A, "CUDNN_OPS", ())
    assert A._cudnn_load.__wrapped__() == (op, True, None)
    assert A._cudnn_fn is op  # what the compiled layers call


def test_a_module_that_does_not_import_is_a_reason(monkeypatch):
    _fake_frontend(monkeypatch, broken="cudnn.sdpa.packed_lse")
    monkeypatch.setattr(A, "CUDNN_OPS", ())
    fn, installed, why = A._cudnn_load.__wrapped__()
    assert fn is None and installed and "cudnn.sdpa.packed_lse" in why and "\n" not in why


@pytest.fixture
def fake_cuda(monkeypatch, kernel_choice):
    """A CUDA device 0 of compute capability 9.0 with the frontend loaded (nothing resolved yet)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(A, "_cudnn_load", lambda: (object(), True, None))
    monkeypatch.setattr(A, "_resolved", {})
    monkeypatch.setattr(A, "_probed", {})


_CRASH = "AttributeError: '_OpNamespace' 'cudnn' object has no attribute '_packed_lse_to_padded'"


def test_auto_falls_back_to_flash_with_one_warning_when_the_probe_fails(monkeypatch, fake_cuda, capsys):
    probes = []
    monkeypatch.setattr(A, "_cudnn_probe", lambda index: probes.append(index) or _CRASH)
    A.set_varlen_kernel("auto")
    assert A._resolved == {("auto", 0): "flash"}  # recorded: every layer reads the same kernel
    for _ in range(3):  # later layers and steps ask again: no second probe, no second warning
        assert A._resolve(0) == "flash"
    assert probes == [0]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgs: warning: ") and "_packed_lse_to_padded" in lines[0]
    assert "FlashAttention-2" in lines[0]


def test_auto_keeps_cudnn_when_the_probe_passes(monkeypatch, fake_cuda, capsys):
    monkeypatch.setattr(A, "_cudnn_probe", lambda index: None)
    A.set_varlen_kernel("auto")
    assert A._resolved == {("auto", 0): "cudnn"}
    assert capsys.readouterr().err == ""


def test_explicit_cudnn_that_fails_the_probe_is_a_spec_error(monkeypatch, fake_cuda):
    from pgs.errors import EXIT_BAD_INPUT

    monkeypatch.setattr(A, "_cudnn_probe", lambda index: _CRASH)
    with pytest.raises(SpecError, match=r"model\.varlen_kernel: \"cudnn\" failed its first") as info:
        A.set_varlen_kernel("cudnn")
    assert "\n" not in str(info.value) and "_packed_lse_to_padded" in str(info.value)
    assert info.value.exit_code == EXIT_BAD_INPUT
    assert ("cudnn", 0) not in A._resolved


def test_a_frontend_that_does_not_load_falls_back_or_refuses(monkeypatch, fake_cuda, capsys):
    why = "its SDPA op did not load (ImportError: no module named cudnn.sdpa.packed_lse)"
    monkeypatch.setattr(A, "_cudnn_load", lambda: (None, True, why))
    monkeypatch.setattr(A, "_cudnn_probe", lambda index: pytest.fail("no probe without an op"))
    A.set_varlen_kernel("auto")
    assert A._resolved == {("auto", 0): "flash"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pgs: warning: ") and "packed_lse" in err[0]
    with pytest.raises(SpecError, match="installed but its SDPA op did not load"):
        A.set_varlen_kernel("cudnn")
    # not installed at all: "auto" takes FlashAttention-2 silently, as planned
    monkeypatch.setattr(A, "_cudnn_load", lambda: (None, False, "nvidia-cudnn-frontend is not installed"))
    monkeypatch.setattr(A, "_resolved", {})
    A.set_varlen_kernel("auto")
    assert A._resolved == {("auto", 0): "flash"} and capsys.readouterr().err == ""


def test_build_model_resolves_the_kernel_before_any_layer_runs(monkeypatch, fake_cuda, capsys):
    probes = []
    monkeypatch.setattr(A, "_cudnn_probe", lambda index: probes.append(index) or _CRASH)
    arch = dict(model_type="qwen3", head_dim=8, **TINY)
    build_model(config=arch, attn_implementation="sdpa")  # no packed kernel used: none probed
    assert probes == [] and A._resolved == {}
    build_model(config=arch, attn_implementation="varlen")
    assert A._resolved == {("auto", 0): "flash"} and probes == [0]
    assert capsys.readouterr().err.count("pgs: warning:") == 1
    with pytest.raises(SpecError, match="model.varlen_kernel"):
        build_model(config=arch, attn_implementation="varlen", varlen_kernel="cudnn")


def _right(q, k, v, cu, longest, scale):
    return A._reference(q, k, v, cu, 1, longest, scale)


class _BackwardCrash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        raise AttributeError("'_OpNamespace' 'cudnn' object has no attribute '_packed_lse_to_padded'")


@pytest.mark.parametrize("kernel, verdict", [
    (_right, None),
    (lambda q, k, v, cu, n, s: _BackwardCrash.apply(_right(q, k, v, cu, n, s)), "AttributeError: '_OpNamespace'"),
    (lambda q, k, v, cu, n, s: _right(q, k, v, cu, n, s) * 1.5, "its output is off the reference"),
    (lambda q, k, v, cu, n, s: _right(q, k, v, cu, n, s) * float("nan"), "its output is not finite"),
    (lambda q, k, v, cu, n, s: _right(q, k.flip(0), v, cu, n, s), "its output is off the reference"),
    (lambda q, k, v, cu, n, s: 1 / 0, "ZeroDivisionError"),
])
def test_the_probe_runs_forward_and_backward_against_the_reference(kernel, verdict):
    """On the CPU with stand-in kernels: a right one passes; a crash in backward, wrong or
    non-finite numbers each give a one-line reason."""
    why = A.probe_kernel(kernel, torch.device("cpu"))
    if verdict is None:
        assert why is None
    else:
        assert why is not None and why.startswith(verdict) and "\n" not in why


_PACKED_LAYER = textwrap.dedent('''
    import torch
    from pgs.runtime.model import attention as A
    from pgs.runtime.model.layers import compile_layers
    from pgs.runtime.model.build import build_model, final_hidden

    config = dict(model_type="qwen3", vocab_size=512, hidden_size=512, intermediate_size=1024,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  max_position_embeddings=2048)
    model = build_model(config=config, dtype="bfloat16", device="cuda")  # varlen_kernel "auto"
    assert A.uses_varlen(model)
    compile_layers(model)
    rows = [(300, 500, 224), (100,) * 10 + (24,)]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).cuda()
    ids = torch.randint(0, 512, pos.shape, device="cuda")
    for step in range(2):
        h = final_hidden(model, ids, pos)
        h.float().square().mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()
    torch.cuda.synchronize()
    print("kernel", A._resolve(torch.cuda.current_device()))
''')


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not A.varlen_available("cuda", torch.bfloat16), reason="needs CUDA and torch's varlen_attn")
def test_cuda_fresh_processes_run_a_compiled_packed_layer_with_the_default_kernel(tmp_path):
    """Issue 19: fresh processes (the frontend's modules not yet imported), each a compiled packed
    forward + backward through pgs's varlen attention under the default kernel.  Where "auto" picks
    cuDNN, each must run it (no fallback warning): the eager imports, not the fallback, are the fix."""
    script = tmp_path / "packed_layer.py"
    script.write_text(_PACKED_LAYER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(tmp_path)) for _ in range(5)]
    results = [p.communicate(timeout=600) for p in procs]
    expected = ("cudnn" if A._cudnn_thd() is not None
                and torch.cuda.get_device_capability() in A.CUDNN_AUTO_CAPABILITIES else "flash")
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
        assert f"kernel {expected}" in out, (out, err[-3000:])
        if expected == "cudnn":
            assert "pgs: warning: cuDNN" not in err, err[-3000:]
