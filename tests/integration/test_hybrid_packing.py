"""Hybrid linear-attention models packed: every document gets the logits and gradients it gets
alone (tiny random-init configs of each family transformers ships with Gated DeltaNet layers),
and what pgs refuses about them (context parallelism, a freeze that would freeze nothing)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pgs.errors import SpecError
from pgs.runtime.data import Document, collate, packing_isolation, require_packing_isolation
from pgs.runtime.model import linear_attention as LA
from pgs.runtime.model.build import build_config, build_model, final_hidden, freeze
from helpers import cli_error, cpu_spec

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
#: What every family's tiny config shares: 2 linear-attention and 2 attention layers, 2 key heads
#: serving 4 value heads in the linear layers, a 4-wide convolution.
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYERS,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_5_text": dict(model_type="qwen3_5_text", head_dim=8, intermediate_size=64),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", head_dim=8, **MOE),
    "qwen3_next": dict(model_type="qwen3_next", head_dim=8, intermediate_size=64, **MOE),
    "olmo_hybrid": dict(model_type="olmo_hybrid", intermediate_size=64),
}
#: Documents of 7, 70 (more than one 64-token chunk of the delta rule) and 9 tokens in two
#: padded rows: [7, 70, 9] and [70, 9].
LENGTHS = (7, 70, 9)
WIDTH = 96


def table(family: str) -> dict:
    return {**COMMON, **FAMILIES[family]}


def tiny(family: str, dtype=torch.float32, attn: str = "sdpa", device: str = "cpu"):
    return build_model(config=table(family), dtype=dtype, attn_implementation=attn, device=device).eval()


def documents():
    g = torch.Generator().manual_seed(1)
    docs = [Document(tuple(torch.randint(3, 96, (n,), generator=g).tolist()), (True,) * n) for n in LENGTHS]
    return [docs, docs[1:]]


def packed_vs_alone(model, rows, device="cpu"):
    """Largest |Δ| between each document's logits packed (``final_hidden``, the training
    forward) and alone, and between the parameter gradients of ``Σ_d <w_d, logits_d>`` both ways."""
    batch = collate(rows, pad_id=0, seq_len=WIDTH)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(len(d), 96, generator=g).to(device) for row in rows for d in row]
    h = final_hidden(model, batch.input_ids.to(device), batch.position_ids.to(device))
    packed = model.lm_head(h)
    spans = [(r, s, e) for r, row in enumerate(rows)
             for s, e in zip(batch.cu_seqlens[r].tolist(), batch.cu_seqlens[r].tolist()[1:])]
    alone = [model(input_ids=torch.tensor([d.input_ids], device=device), use_cache=False).logits[0]
             for row in rows for d in row]
    forward = max(float((packed[r, s:e].float() - a.float()).detach().abs().max()) for (r, s, e), a in zip(spans, alone))

    def grads(loss):
        got = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if x is None else x for p, x in zip(params, got)]

    g_packed = grads(sum((packed[r, s:e].float() * w).sum() for (r, s, e), w in zip(spans, weights)))
    g_alone = grads(sum((a.float() * w).sum() for a, w in zip(alone, weights)))
    backward = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g_packed, g_alone))
    scale = max(float(b.float().abs().max()) for b in g_alone)
    return forward, backward, scale


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_equal_alone_forward_and_gradients(family, dtype, tol):
    model = tiny(family, dtype)
    assert LA.isolate(model) == 2 and packing_isolation(model).isolates
    forward, backward, scale = packed_vs_alone(model, documents())
    assert forward < tol, f"logits differ by {forward:.3g}"
    assert backward < tol * max(scale, 1.0), f"gradients differ by {backward:.3g} (largest {scale:.3g})"


def test_without_the_boundaries_the_linear_layers_leak():
    """The same comparison on the plain transformers model: what the boundaries fix is real."""
    torch.manual_seed(0)
    config = build_config(table("qwen3_5_text"))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    verdict = packing_isolation(model)
    assert not verdict.isolates and "not given document boundaries" in verdict.reason
    assert not LA.wants_boundaries(model)  # final_hidden passes it none: transformers' path as it is
    forward, backward, _ = packed_vs_alone(model, documents())
    assert forward > 1e-3 and backward > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5_text", "olmo_hybrid"])
def test_varlen_attention_on_a_hybrid_isolates(family):
    """``attn_implementation = "varlen"``: attention layers through the packed-attention
    function, linear-attention layers through their boundaries (CPU: both reference paths)."""
    model = tiny(family, attn="varlen")
    forward, backward, scale = packed_vs_alone(model, documents())
    assert forward < 1e-5 and backward < 1e-5 * max(scale, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_equal_alone_on_cuda(family, dtype, tol):
    """On CUDA through the fused path (fla's convolution and delta rule given the boundaries)
    where flash-linear-attention is installed, else through the per-document path.  The
    documents alone run transformers' own forward (fla's delta rule where installed).  fp32's
    tolerance: fla's kernels multiply in TF32."""
    model = tiny(family, dtype, device="cuda")
    assert LA.path(torch.device("cuda")) == ("fused" if LA.fused_available() else "per_document")
    forward, backward, scale = packed_vs_alone(model, documents(), device="cuda")
    assert forward < tol and backward < tol * max(scale, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_fused_path_equals_per_document_path_on_cuda(family, dtype, tol, monkeypatch):
    """The fused path (fla only: its causal convolution and ``chunk_gated_delta_rule`` with
    ``cu_seqlens``) against the per-document path on the same model and rows: logits and
    parameter gradients."""
    if not LA.fused_available():
        pytest.skip("flash-linear-attention is not installed")
    model = tiny(family, dtype, device="cuda")
    batch = collate(documents(), pad_id=0, seq_len=WIDTH)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(route):
        monkeypatch.setattr(LA, "path", lambda device: route)
        h = final_hidden(model, batch.input_ids.cuda(), batch.position_ids.cuda())
        logits = model.lm_head(h).float()
        grads = torch.autograd.grad((logits * torch.linspace(-1, 1, logits.shape[-1], device="cuda")).sum(),
                                    params, allow_unused=True)
        return logits.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    calls = []
    fused = LA._fused
    monkeypatch.setattr(LA, "_fused", lambda *a: calls.append(1) or fused(*a))
    got, got_grads = run("fused")
    assert len(calls) == 2  # both linear-attention layers took the fused path
    want, want_grads = run("per_document")
    assert float((got - want).abs().max()) < tol
    scale = max(float(g.abs().max()) for g in want_grads)
    assert max(float((a - b).abs().max()) for a, b in zip(got_grads, want_grads)) < tol * max(scale, 1.0)


def test_the_cpu_takes_the_per_document_path():
    assert LA.path(torch.device("cpu")) == "per_document"


def test_isolation_verdicts_by_config():
    for family in FAMILIES:
        assert packing_isolation(build_config(table(family))).isolates, family
    outer = PretrainedConfig(model_type="qwen3_5")
    outer.text_config = build_config(table("qwen3_5_text"))
    assert packing_isolation(outer).isolates
    refused = {
        "mamba": PretrainedConfig(model_type="mamba"),
        "linear_attention": PretrainedConfig(model_type="somehybrid", layer_types=["linear_attention"]),
        "mamba2": PretrainedConfig(model_type="qwen3_5_text", layer_types=["full_attention", "mamba2"]),
    }
    for name, config in refused.items():
        verdict = packing_isolation(config)
        assert not verdict.isolates and name in verdict.reason, verdict
        with pytest.raises(SpecError, match="allow_packing_leakage"):
            require_packing_isolation(config)


def test_an_unknown_linear_attention_layer_class_is_refused():
    model = tiny("qwen3_5_text")
    layer = LA.linear_layers(model)[0]
    layer.__class__ = type("SomeOtherGatedDeltaNet", (type(layer),), {})
    verdict = packing_isolation(model)
    assert not verdict.isolates and "SomeOtherGatedDeltaNet" in verdict.reason


def test_freeze_non_attention_refuses_a_model_without_linear_layers():
    from tiny import tiny_table

    with pytest.raises(SpecError, match="would freeze nothing"):
        freeze(build_model(config=dict(tiny_table(), vocab_size=96)), "non_attention")
    frozen = freeze(tiny("qwen3_5_text"), "non_attention")
    assert frozen and all(".linear_attn." in n or n.split(".")[2] in ("0", "2") for n in frozen)


def _toml(family: str, **extra) -> str:
    values = {k: v for k, v in table(family).items() if k != "vocab_size"}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
    head = "".join(f"{k} = {json.dumps(v)}\n" for k, v in extra.items())
    return head + "\n[model.config]\n" + lines


def test_validate_refuses_context_parallel_on_a_hybrid(tmp_path, capsys):
    spec = cpu_spec(tmp_path, model=_toml("qwen3_5_text"))
    code, line = cli_error(["validate", str(spec), "--set", "parallel.context=2"], capsys)
    assert code == 2
    assert line.startswith("pgs: error: parallel.context = 2: 'qwen3_5_text' has linear_attention layers")


def test_validate_refuses_non_attention_freeze_without_linear_layers(tmp_path, capsys):
    from helpers import CPU_CONFIG

    spec = cpu_spec(tmp_path, model='freeze = "non_attention"\n' + CPU_CONFIG)
    code, line = cli_error(["validate", str(spec)], capsys)
    assert code == 2 and line.startswith("pgs: error: model.freeze: \"non_attention\" would freeze nothing")


def test_a_packed_hybrid_trains_with_varlen_and_frozen_linear_layers(tmp_path, capsys):
    """``pgs run`` of a packed qwen3_5_text, varlen attention, linear-attention layers frozen."""
    from pgs.cli import main

    spec = cpu_spec(tmp_path, model=_toml("qwen3_5_text", attn_implementation="varlen", freeze="non_attention"))
    assert main(["run", str(spec)]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r and r["loss"] == r["loss"] for r in records)


def test_a_deep_copy_keeps_its_own_boundary_forward():
    """A preference run's reference is a deep copy of the policy: its layers must run themselves."""
    import copy

    model = tiny("qwen3_5_text")
    clone = copy.deepcopy(model)
    assert LA.wants_boundaries(clone) and LA.isolated(clone)
    assert all(layer.forward.__self__ is layer for layer in LA.linear_layers(clone))
    forward, _, _ = packed_vs_alone(clone, documents())
    assert forward < 1e-5


@pytest.mark.slow
def test_checkpointed_and_compiled_layers_keep_the_documents_apart():
    """Full activation checkpointing and compiled decoder layers around the boundary forward
    (``backend="eager"``: dynamo's graph capture without a code generator)."""
    from pgs.runtime.model.layers import apply_activation_checkpointing, compile_layers

    model = tiny("qwen3_5_text")
    apply_activation_checkpointing(model, "full")
    compile_layers(model, backend="eager")
    forward, backward, scale = packed_vs_alone(model, documents())
    assert forward < 1e-5 and backward < 1e-5 * max(scale, 1.0)


def _segments(cu):
    bounds = cu.tolist()
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_route_hands_the_boundaries_to_both_kernels(family, monkeypatch):
    """The fused CUDA route on the CPU, with stand-ins for fla's ``causal_conv1d`` and
    ``chunk_gated_delta_rule`` (same signatures) that honour ``cu_seqlens`` by running
    transformers' reference on each segment: what the route computes around the two kernels
    (each family's projections, the split into q, k, v, the decay, β, the gated norm, the output
    projection) is the layer's own forward, and both kernels get one batch-1 sequence and int64
    boundaries."""
    import sys

    import torch.nn.functional as F

    model = tiny(family)
    module = sys.modules[type(LA.linear_layers(model)[0]).__module__]
    rule_ref = getattr(module.torch_chunk_gated_delta_rule, "__wrapped__", module.torch_chunk_gated_delta_rule)
    seen = {"rule": [], "conv": []}

    def rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64 and g.dtype == torch.float32
        seen["rule"].append(cu_seqlens)
        parts = [rule_ref(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for a, b in _segments(cu_seqlens)]
        return torch.cat(parts, 1), None

    def conv(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
        assert x.shape[0] == 1 and weight.dim() == 2 and cu_seqlens.dtype == torch.int64 and activation == "silu"
        seen["conv"].append(cu_seqlens)
        width = weight.shape[-1]
        parts = [F.conv1d(x[:, a:b].transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                          groups=x.shape[-1])[..., :b - a] for a, b in _segments(cu_seqlens)]
        return F.silu(torch.cat(parts, -1)).transpose(1, 2), None

    monkeypatch.setattr(LA, "_KERNELS", [(conv, rule)])
    monkeypatch.setattr(LA, "path", lambda device: "fused")
    assert all(LA.fusable(layer) for layer in LA.linear_layers(model))
    rows = documents()
    forward, backward, scale = packed_vs_alone(model, rows)
    assert forward < 1e-5 and backward < 1e-5 * max(scale, 1.0)
    want = torch.tensor([0, 7, 77, 86, 96, 166, 175, 192])  # 2 rows of 96: documents, then padding
    assert len(seen["rule"]) == 2 and all(torch.equal(cu, want) for cu in seen["rule"])
    assert len(seen["conv"]) == 2 and all(torch.equal(cu, want) for cu in seen["conv"])


@pytest.mark.parametrize("family", ["qwen3_5_text"])
def test_sublayer_checkpointing_of_hybrid_layers_keeps_packed_loss_and_gradients(family):
    """``memory.activation_checkpointing = "sublayer"`` on a hybrid: each layer's mixer (Gated
    DeltaNet or attention) and its MLP checkpointed apart, packed rows with their boundaries:
    logits and gradients equal the unchecked model's (which equal each document alone)."""
    from pgs.runtime.model.layers import apply_activation_checkpointing, decoder_layers

    def grads_of(model):
        model.train()
        batch = collate(documents(), pad_id=0, seq_len=WIDTH)
        logits = model.lm_head(final_hidden(model, batch.input_ids, batch.position_ids))
        (logits * torch.linspace(-1, 1, 96)).sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = grads_of(tiny(family))
    model = tiny(family)
    assert apply_activation_checkpointing(model, "sublayer") == [0, 1, 2, 3]
    calls = []
    mixer = LA.linear_layers(model)[0]
    inner = mixer.forward
    mixer.forward = lambda *a, **k: calls.append(torch.is_grad_enabled()) or inner(*a, **k)
    got, got_grads = grads_of(model)
    assert calls == [False, True]  # run without autograd in forward, recomputed in backward
    assert torch.allclose(got, want, atol=1e-6) and got_grads.keys() == want_grads.keys()
    assert all(torch.allclose(got_grads[n], want_grads[n], atol=1e-6) for n in want_grads)
    assert any(".linear_attn." in n for n in got_grads)
    assert type(decoder_layers(model)[0]).__name__ != "OlmoHybridAttentionDecoderLayer"


def test_sublayer_checkpointing_refuses_post_norm_attention_layers():
    """OLMo-Hybrid's attention layers normalize after the mixer (not ``x + mixer(norm(x))``)."""
    from pgs.errors import InvalidArgument
    from pgs.runtime.model.layers import apply_activation_checkpointing

    with pytest.raises(InvalidArgument, match="OlmoHybridAttentionDecoderLayer"):
        apply_activation_checkpointing(tiny("olmo_hybrid").train(), "sublayer")


def _saved_by_layer(model, ids):
    """Bytes autograd saves in one forward, by the decoder layer running (parameters not
    counted), and the parameter gradients of the logits' weighted sum."""
    from pgs.runtime.model.layers import decoder_layers

    where, saved = [None], {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i))
             for i, layer in enumerate(decoder_layers(model))]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[where[0]] = saved.get(where[0], 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
    (logits * torch.linspace(-1, 1, 96)).sum().backward()
    for h in hooks:
        h.remove()
    return saved, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy", ["none", "sublayer"])
def test_frozen_layers_below_the_first_trainable_one_save_nothing(policy):
    """Selective differentiation: linear-attention layers frozen (``freeze = "non_attention"``)
    and the untied embedding frozen, the two linear-attention layers under the first attention
    layer need no backward; ``skip_frozen_prefix`` runs them without autograd.  Measured: they
    save nothing (with sublayer checkpointing each kept its two inputs, 2·b·h per token), the
    layers above save what they saved, gradients are unchanged."""
    from pgs.runtime.model.layers import apply_activation_checkpointing, frozen_prefix, skip_frozen_prefix

    def build(skip):
        model = build_model(config={**table("qwen3_5_text"), "tie_word_embeddings": False, "layer_types": [
            "linear_attention", "linear_attention", "full_attention", "linear_attention"]}).train()
        freeze(model, "non_attention")
        assert frozen_prefix(model) == 0  # the embedding is trainable: backward reaches it through all
        model.model.embed_tokens.weight.requires_grad_(False)
        assert frozen_prefix(model) == 2
        if skip:
            assert skip_frozen_prefix(model) == [0, 1]
        apply_activation_checkpointing(model, policy)
        return model

    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    without, want = _saved_by_layer(build(False), ids)
    with_skip, got = _saved_by_layer(build(True), ids)
    below = without.get(0, 0) + without.get(1, 0)
    assert with_skip.get(0, 0) == with_skip.get(1, 0) == 0
    assert below == (2 * 2 * 4 * 32 * ids.numel() if policy == "sublayer" else 0)  # autograd alone saves none
    assert {k: v for k, v in with_skip.items() if k not in (0, 1)} == {k: v for k, v in without.items() if k not in (0, 1)}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


class _KeepsNothing(torch.autograd.Function):
    """A kernel stand-in that saves nothing for backward (its output: zeros of ``like``'s shape)."""

    @staticmethod
    def forward(ctx, like, *inputs):
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * len(ctx.needs_input_grad)


def _linear_layer_saved(model):
    """Bytes autograd saves in decoder layer 1 (a linear-attention layer) in the packed training
    forward of two rows of 16 tokens, parameters not counted, each storage once."""
    from pgs.runtime.model.layers import decoder_layers

    where, saved = [None], {}
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i))
    model.model.norm.register_forward_pre_hook(lambda m, a: where.__setitem__(0, "norm"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if where[0] == 1 and t.dtype != torch.long and key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    rows = [[Document(tuple(range(3, 13)), (True,) * 10), Document(tuple(range(3, 9)), (True,) * 6)],
            [Document(tuple(range(3, 19)), (True,) * 16)]]
    batch = collate(rows, pad_id=0, seq_len=16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        final_hidden(model, batch.input_ids.to(model.device), batch.position_ids.to(model.device))
    return sum(saved.values()), 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_profile_linear_attention_term_around_the_kernels_equals_saved_tensors(dtype, monkeypatch):
    """``pgs profile``'s Gated DeltaNet layer (``activation_parts``): what autograd keeps around
    fla's two kernels (projections, β, the decay, the gated norm, the output projection, the
    norms and the MLP), measured on the CPU through the fused route with stand-in kernels that
    keep nothing; the per-layer constants (the norms' 1 + w, exp(A_log)) aside.  The kernels'
    own term is measured on CUDA (test_profile_linear_attention_layer_on_cuda)."""
    from pgs.runtime.tools.profile import _fp32_norm, _linear_mixer_bytes

    config = {**table("qwen3_5_text"), "num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
    model = build_model(config=config, dtype=dtype).train()
    conv = lambda x, weight, bias=None, **_: (_KeepsNothing.apply(x, x), None)  # noqa: E731
    rule = lambda q, k, v, g, beta, **_: (_KeepsNothing.apply(v, q, k, v, g, beta), None)  # noqa: E731
    monkeypatch.setattr(LA, "_KERNELS", [(conv, rule)])
    monkeypatch.setattr(LA, "path", lambda device: "fused")
    measured, tokens = _linear_layer_saved(model)
    c, b, h = build_config(config), dtype.itemsize, 32
    assert _fp32_norm(c)
    norm, mlp = 8 * h + 4, 4 * b * 64
    predicted = (2 * norm + 2 * b * h + mlp + _linear_mixer_bytes(c, b, kernels=False)) * tokens
    constants = 2 * 4 * h + 2 * 4 * 4  # the two norms' fp32 1 + w, exp(A_log) and its negation
    assert measured == predicted + constants


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_profile_linear_attention_layer_on_cuda(dtype):
    """The whole Gated DeltaNet layer term, fla's kernels included, against what autograd keeps
    on CUDA through the fused path (within 2%: the kernels' per-sequence extras)."""
    from pgs.runtime.tools.profile import _linear_mixer_bytes

    if not LA.fused_available():
        pytest.skip("flash-linear-attention is not installed")
    config = {**table("qwen3_5_text"), "num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
    model = build_model(config=config, dtype=dtype, device="cuda").train()
    measured, tokens = _linear_layer_saved(model)
    b, h = dtype.itemsize, 32
    predicted = (2 * (8 * h + 4) + 2 * b * h + 4 * b * 64 + _linear_mixer_bytes(build_config(config), b)) * tokens
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


def test_the_qwen3_5_4b_recipe_is_predicted_within_16_gib():
    """specs/qwen3_5_4b_16gib.toml: ``pgs profile``'s peak for one CUDA process is at most 16 GiB,
    its linear-attention layers frozen (no gradient, no state) and sublayer-checkpointed."""
    from pathlib import Path

    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.tools.profile import GiB, plan_from_spec, predict

    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "qwen3_5_4b_16gib.toml")
    plan = plan_from_spec(spec)
    model = plan["kwargs"]["model"]
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".linear_attn." in n)
    assert plan["options"]["activation_checkpointing"] == "sublayer"
    assert predict(spec, torch.device("cuda")).peak <= 16 * GiB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_profile_attention_layers_of_a_hybrid_equal_saved_tensors(family, dtype):
    """``activation_parts`` on a hybrid family's attention layers ((1 + w) norms in fp32, the
    sigmoid output gate, a quarter of each head rotated) equals what autograd saves, as it does
    for Qwen3's; the per-norm constants (1 + w in fp32, [h] or [d]) aside."""
    from pgs.runtime.tools.profile import activation_bytes

    config = {**table(family), "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    if family == "qwen3_next":
        config["num_experts"] = 0  # a dense MLP: the experts' term is tested on Qwen3-MoE
    model = build_model(config=config, dtype=dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if t.dtype != torch.long and key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    B, S = 2, 16
    ids = torch.randint(3, 96, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model.model(input_ids=ids, position_ids=torch.arange(S).expand(B, S), use_cache=False).last_hidden_state
    measured = sum(saved.values()) + h.numel() * h.element_size()
    constants = (2 * 2 + 1) * 4 * 32 + 2 * 2 * 4 * 8  # five hidden norms' 1 + w, two q/k norms per layer
    assert measured - constants == activation_bytes(build_config(config), B * S, dtype=dtype, policy="none")
