"""The tied weight stepped in row slabs (``GradientRelease(..., memory=pf.MemoryOptions(tied_slabs=rows))``): no dense
V×D gradient, and the same weights and state as the deferred path (tests/unit/test_release_defer.py)
up to summation order, on the CPU in fp32."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.func import kernels as K
from pgs.errors import InvalidArgument
from pgs.func.losses import token_loss
from pgs.func.quant8 import Quantized8bit
from pgs.runtime.model.build import final_hidden, output_head
from pgs.runtime.optim.release import GradientRelease
from test_release import batches, tiny_model

CHAINS = {  # 8-bit state on the 96×32 embedding: blocks of 64 elements = 2 rows
    "lion8bit": lambda: pf.lion8bit(1e-3, weight_decay=0.1, block_size=64, min_8bit_size=256),
    "adamw8bit": lambda: pf.adamw8bit(1e-2, weight_decay=0.1, block_size=64, min_8bit_size=256),
    "adamw": lambda: pf.adamw(1e-2, weight_decay=0.1),
}


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # backend="triton" tests: a GPU, else the interpreter


def step(model, ids, release, chunk=7, z_loss=0.0, softcap=None):
    ids = ids.to(next(model.parameters()).device)
    h = final_hidden(model, ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
    W, bias, cap = output_head(model)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    r = token_loss(h, W, labels, bias=bias, softcap=softcap or cap, chunk_size=chunk, z_loss=z_loss,
                   memory=pf.MemoryOptions(defer_head_grad=True))
    release.before_step(W, r.head_grad if release.memory.tied_slabs else r.head_grad.add_to)
    (r.loss_sum / r.num_valid).backward()


def state_leaves(rel):
    import torch.utils._pytree as _pt

    return _pt.tree_leaves(rel.states, is_leaf=lambda x: isinstance(x, Quantized8bit))


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_slabs_equal_the_deferred_path(name):
    data = batches(3)
    a, b = tiny_model(), tiny_model()
    seen = []  # before the release's hook: what W.grad is when autograd is done with W
    b.model.embed_tokens.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    ref = GradientRelease(CHAINS[name](), a)
    rel = GradientRelease(CHAINS[name](), b, memory=pf.MemoryOptions(tied_slabs=10))  # 10 slabs, the last one 6 rows
    for i, ids in enumerate(data):
        step(a, ids, ref, softcap=30.0 if i == 1 else None, z_loss=1e-3 if i == 2 else 0.0)
        step(b, ids, rel, softcap=30.0 if i == 1 else None, z_loss=1e-3 if i == 2 else 0.0)
        assert all(p.grad is None for p in b.parameters())
    assert all(g is None for g in seen) and rel.counts() == {3} and rel.steps == 3
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    for x, y in zip(state_leaves(ref), state_leaves(rel)):
        if isinstance(x, Quantized8bit):  # codes within one code, scales to rounding
            assert (x.codes.int() - y.codes.int()).abs().max() <= 1
            torch.testing.assert_close(y.absmax, x.absmax, rtol=1e-4, atol=1e-8)
        else:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    assert abs(rel.metrics().grad_norm - ref.metrics().grad_norm) < 1e-5


def test_untied_embedding_and_masters():
    """An untied embedding (no head part: only the seen rows' gradients), fp32 masters of bf16."""
    data = batches(2)
    a, b = tiny_model(tied=False), tiny_model(tied=False)
    ref = GradientRelease(pf.adamw(1e-2, weight_decay=0.1), a)
    rel = GradientRelease(pf.adamw(1e-2, weight_decay=0.1), b, memory=pf.MemoryOptions(tied_slabs=32))
    for ids in data:
        for m in (a, b):
            m(input_ids=ids, labels=ids).loss.backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    assert ref.counts() == rel.counts() == {2}
    c = tiny_model(dtype=torch.bfloat16)
    rel = GradientRelease(pf.lion(1e-3), c, memory=pf.MemoryOptions(tied_slabs=16), master_weights="fp32")
    w0 = c.model.embed_tokens.weight.detach().clone()
    step(c, data[0], rel)
    master = rel.masters["model.embed_tokens.weight"]
    assert torch.equal(c.model.embed_tokens.weight, master.to(torch.bfloat16))
    assert not torch.equal(c.model.embed_tokens.weight, w0)


@pytest.mark.parametrize("chain, cause", [
    (lambda: pf.chain(pf.clip_by_norm_per_tensor(1.0), pf.lion8bit(1e-3)), "per_tensor"),
    (lambda: pf.muon(1e-3), "matrix"),
])
def test_refuses_chains_that_are_not_row_separable(chain, cause):
    with pytest.raises(InvalidArgument, match=f"is {cause}.*not row-separable"):
        GradientRelease(chain(), tiny_model(), memory=pf.MemoryOptions(tied_slabs=8))


def test_refusals():
    model = tiny_model()
    with pytest.raises(InvalidArgument, match="whole rows of a slab"):  # 3 rows × 32 = 96, blocks of 64
        GradientRelease(CHAINS["lion8bit"](), model, memory=pf.MemoryOptions(tied_slabs=3))
    with pytest.raises(InvalidArgument, match="nn.Module"):
        GradientRelease(pf.adamw(1e-2), dict(model.named_parameters()), memory=pf.MemoryOptions(tied_slabs=8))
    with pytest.raises(InvalidArgument, match="shares its release group"):
        GradientRelease(pf.adamw(1e-2), model, memory=pf.MemoryOptions(tied_slabs=8), groups=lambda n: "all")
    rel = GradientRelease(pf.adamw(1e-2), model, memory=pf.MemoryOptions(tied_slabs=8))
    with pytest.raises(InvalidArgument, match="add_rows_to"):
        rel.before_step(model.model.embed_tokens.weight, lambda g: None)
    rel.remove()  # the embedding is a plain nn.Embedding again
    assert "forward" not in model.model.embed_tokens.__dict__


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("name", ["lion8bit", "adamw8bit", "adamw"])
def test_fused_slabs_and_triton_rebuild(name, monkeypatch):
    """The fused per-tensor kernel on the slab's views of param/codes/absmax (or AdamW's fp32
    moments), the head part rebuilt by the loss's Triton pass (interpreter on the CPU): equal
    to the fused deferred path."""
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    if name == "adamw":
        chain = lambda: pf.adamw(1e-3, weight_decay=0.1)  # noqa: E731
    else:
        make = {"lion8bit": pf.lion8bit, "adamw8bit": pf.adamw8bit}[name]
        chain = lambda: make(1e-3, weight_decay=0.1, block_size=64, min_8bit_size=256, backend="triton")  # noqa: E731
    data = batches(2)
    a, b = tiny_model(layers=1).to(DEV), tiny_model(layers=1).to(DEV)
    ref = GradientRelease(chain(), a)
    rel = GradientRelease(chain(), b, memory=pf.MemoryOptions(tied_slabs=32))
    for ids in data:
        step(a, ids, ref, chunk=16)
        step(b, ids, rel, chunk=16)
    assert rel.plain_group_steps == 0 and rel.fused_group_steps == ref.fused_group_steps > 0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    for x, y in zip(state_leaves(ref), state_leaves(rel)):
        if isinstance(x, Quantized8bit):
            assert (x.codes.int() - y.codes.int()).abs().max() <= 1


def test_pgs_run_with_tied_slabs_matches_the_deferred_run(tmp_path):
    """``[memory] tied_slabs`` in ``pgs run``: the same run as the deferred one up to summation
    order, and a checkpoint's optimizer state has the same keys (slabs are views of it)."""
    from safetensors.torch import load_file

    from helpers import step_records
    from test_train_release import _run_in_process, release_spec

    for name, slabs in (("deferred", 0), ("slabs", 16)):
        path = release_spec(tmp_path, name, defer=True, every=3, steps=3)
        path.write_text(path.read_text() + f"tied_slabs = {slabs}\n")
        assert _run_in_process(path) == 0
    for what in ("model", "optimizer"):
        a = load_file(tmp_path / "deferred" / "step_3" / f"{what}.safetensors")
        b = load_file(tmp_path / "slabs" / "step_3" / f"{what}.safetensors")
        assert sorted(a) == sorted(b)
        for k in a:
            if a[k].is_floating_point():
                torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    la = [r["loss"] for r in step_records(tmp_path / "deferred")]
    lb = [r["loss"] for r in step_records(tmp_path / "slabs")]
    assert lb == pytest.approx(la, rel=1e-5)


@pytest.mark.parametrize("sets, message", [
    (["memory.gradient_release=false"], "memory.tied_slabs = 16: the embedding's weight is stepped"),
    (["chain=clip"], "memory.tied_slabs: optimizer.chain: chain[0] (clip_by_norm_per_tensor) is per_tensor"),
])
def test_spec_refusals(tmp_path, sets, message):
    from pgs.errors import SpecError
    from pgs.runtime.spec.load import load_spec
    from test_train_release import release_spec

    path = release_spec(tmp_path, "bad")
    text = path.read_text() + "tied_slabs = 16\n"
    if sets == ["chain=clip"]:
        start, end = text.index("[optimizer]"), text.index("[schedule]")
        text = (text[:start] + '[optimizer]\nchain = [{ name = "clip_by_norm_per_tensor", max_norm = 1.0 }, '
                '{ name = "adamw" }]\n\n' + text[end:])
        sets = []
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path, sets)
    assert str(err.value).startswith(message), str(err.value)


def test_profile_replaces_the_tied_gradient_by_a_slab():
    from pgs.runtime.tools.profile import predict_memory

    cfg = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32768, tie_word_embeddings=True)
    kw = dict(chain=pf.lion8bit(1e-5), gradient_release=True, activation_checkpointing="full",
              micro_batch_tokens=512, loss_chunk=128)
    dense, slabs = predict_memory(dict(cfg), **kw), predict_memory(dict(cfg), tied_slabs=1024, **kw)
    V, D, b, n = 32768, 256, 2, 512
    layer = max(dense["gradients"] - V * D * b, slabs["gradients"])  # a decoder layer's gradients
    assert dense["gradients"] == V * D * b and slabs["gradients"] == max(layer, 1024 * D * b)
    # the end of backward: V·D·b + a V-wide rebuilt chunk became a slab, the rows and their sums
    static = dense["weights"] + dense["optimizer_state"]
    held = 2 * n * D * b + 16 * n
    assert dense["peak"] == static + V * D * b + held + 128 * V * b
    last = static + max(held + 2 * n * D * b + 8 * n * D, held + n * D * b + 1024 * D * b + 128 * 1024 * b)
    assert last <= slabs["peak"] < dense["peak"] - V * D * b // 2


def test_pgs_profile_reads_tied_slabs_from_the_spec(tmp_path):
    from pgs.runtime.tools.profile import plan_from_spec
    from pgs.runtime.spec.load import load_spec
    from test_train_release import release_spec

    path = release_spec(tmp_path, "prof", defer=True)
    path.write_text(path.read_text() + "tied_slabs = 16\n")
    spec = load_spec(path)
    assert spec.memory.tied_slabs == 16
    assert plan_from_spec(spec)["kwargs"]["tied_slabs"] == 16


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or Triton's interpreter")
@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or Triton's interpreter")
def test_each_slab_rounds_with_its_own_stream():
    """Stochastic rounding: every slab gets its own Philox stream, none shared with another tensor."""
    model = tiny_model(dtype=torch.bfloat16, layers=1).to(DEV)
    rel = GradientRelease(pf.lion8bit(1e-3, block_size=64, min_8bit_size=256, backend="triton"), model,
                          memory=pf.MemoryOptions(stochastic_rounding=True, tied_slabs=32))
    offsets, inner = [], rel._fused_step

    def spy(fg, state, fp, **kw):
        offsets.append((list(fg), kw["ctx"].sr_offset))
        return inner(fg, state, fp, **kw)

    rel._fused_step = spy
    step(model, batches(1)[0], rel, chunk=16)
    streams = [off + i for names, off in offsets for i in range(len(names))]
    assert len(streams) == len(set(streams)) == len(rel.params) - 1 + 3  # 96 rows = 3 slabs


def test_autograd_grad_through_the_embedding_is_not_a_step():
    """``torch.autograd.grad(loss, [W])`` gets the dense gradient and steps nothing."""
    a, b = tiny_model(), tiny_model()
    rel = GradientRelease(pf.adamw(1e-2), b, memory=pf.MemoryOptions(tied_slabs=8))
    ids = batches(1)[0]
    (ga,) = torch.autograd.grad(a(input_ids=ids, labels=ids).loss, [a.model.embed_tokens.weight])
    (gb,) = torch.autograd.grad(b(input_ids=ids, labels=ids).loss, [b.model.embed_tokens.weight])
    torch.testing.assert_close(gb, ga)
    assert rel.steps == 0 and rel._row_grads.parts == []
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
