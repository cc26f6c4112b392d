"""GradientRelease: the chain inside backward equals bind(...) exactly, frees gradients, refuses
what cannot run inside backward, and checkpoints its state."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument, TreeMismatch
from pgs.runtime.optim.bound import bind
from pgs.runtime.optim.release import GradientRelease, group_of, group_parameters, sublayer_group_of
from tiny import tiny_model as build_tiny

VOCAB = 96


def tiny_model(dtype=torch.float32, tied=True, layers=2, seed=0):
    return build_tiny(seed=seed, dtype=dtype, num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=tied,
                      use_cache=False, attn_implementation="sdpa")


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(n)]


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def run_bind(model, chain, data):
    opt = bind(chain, model)
    for ids in data:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    return opt


def run_release(model, chain, data, **kw):
    rel = GradientRelease(chain, model, **kw)
    for ids in data:
        loss_of(model, ids).backward()
        assert all(p.grad is None for p in model.parameters()), "a gradient outlived backward"
    return rel


CHAINS = {
    "adamw": lambda: pf.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: pf.lion(1e-3, weight_decay=0.1),
    "clip_per_tensor+adam": lambda: pf.chain(
        pf.clip_by_norm_per_tensor(0.05), pf.scale_by_adam(),
        pf.scale_by_learning_rate(pf.cosine_schedule(peak=1e-2, warmup=2, total=10))),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("groups", ["layer", "sublayer", "parameter"])
def test_equals_bind_exactly(name, groups):
    data = batches(3)
    a, b = tiny_model(), tiny_model()
    assert b.lm_head.weight is b.model.embed_tokens.weight  # tied
    ref = run_bind(a, CHAINS[name](), data)
    rel = run_release(b, CHAINS[name](), data, groups=groups)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert rel.counts() == {3}  # every group's count advanced once per step
    assert rel.steps == 3
    assert rel.step_extras["release/host_ms"] > 0  # the last backward's host time in its group steps
    assert rel.metrics().lr == ref.metrics().lr


def test_grouping():
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    groups = group_parameters(names, "layer")
    assert groups["model.layers.0"] == [n for n in names if n.startswith("model.layers.0.")]
    assert groups["model.embed_tokens.weight"] == ["model.embed_tokens.weight"]
    assert "lm_head.weight" not in names  # tied: one parameter, one hook
    assert group_of("model.norm.weight") == "model.norm.weight"
    assert len(group_parameters(names, "parameter")) == len(names)
    # with sizes, the parameters under SMALL_PARAMETER elements step together per layer
    sizes = {n: (100 if "norm" in n else 1 << 20) for n in names}
    by_param = group_parameters(names, "parameter", sizes=sizes)
    small = by_param["model.layers.0/small"]
    assert small and all("norm" in n and n.startswith("model.layers.0.") for n in small)
    assert by_param["model.norm.weight/small"] == ["model.norm.weight"]
    assert all(len(v) == 1 for k, v in by_param.items() if not k.endswith("/small"))
    assert sum(len(v) for v in by_param.values()) == len(names)
    with pytest.raises(InvalidArgument, match="groups"):
        group_parameters(names, "block")


def test_sublayer_groups_split_each_layer_into_its_mlp_and_attention_halves():
    """``"sublayer"``: the MLP and the norm feeding it in one group, the attention and its norm
    (and q/k norms) in the other; parameters outside the layers alone."""
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    groups = group_parameters(names, "sublayer")
    for i in (0, 1):
        mlp, attn = groups[f"model.layers.{i}/mlp"], groups[f"model.layers.{i}/attn"]
        assert sorted(mlp) == sorted(n for n in names if n.startswith(f"model.layers.{i}.")
                                     and (".mlp." in n or "post_attention_layernorm" in n))
        assert f"model.layers.{i}.input_layernorm.weight" in attn
        assert all(".self_attn." in n or "input_layernorm" in n for n in attn)
    assert groups["model.embed_tokens.weight"] == ["model.embed_tokens.weight"]
    assert sum(len(v) for v in groups.values()) == len(names) and len(groups) == 2 * 2 + 2
    assert sublayer_group_of("model.layers.7.block_sparse_moe.experts.3.w1.weight") == "model.layers.7/mlp"
    assert sublayer_group_of("model.layers.7.mlp.experts.gate_up_proj") == "model.layers.7/mlp"
    assert sublayer_group_of("model.layers.7.self_attn.q_norm.weight") == "model.layers.7/attn"
    assert sublayer_group_of("lm_head.weight") == "lm_head.weight"


def test_each_hook_fires_once_tied_included():
    model = tiny_model()
    rel = GradientRelease(pf.sgd(1e-2), model)
    fired: dict[str, int] = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    loss_of(model, batches(1)[0]).backward()
    assert fired == {n: 1 for n, _ in model.named_parameters()}
    assert rel.counts() == {1}


def test_grad_norm_matches_global_norm():
    data = batches(1)
    a, b = tiny_model(), tiny_model()
    loss_of(a, data[0]).backward()
    expected = bind(pf.sgd(1e-2), a).grad_norm()
    rel = run_release(b, pf.sgd(1e-2), data)
    assert rel.metrics().grad_norm == pytest.approx(expected, rel=1e-5)


def test_unused_parameter_steps_with_zero_grad_like_bind():
    data = batches(2)
    a, b = tiny_model(), tiny_model()
    for m in (a, b):
        m.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))
    run_bind(a, pf.adamw(1e-2, weight_decay=0.5), data)
    rel = run_release(b, pf.adamw(1e-2, weight_decay=0.5), data)
    assert torch.equal(a.unused, b.unused) and not torch.equal(b.unused, torch.ones(5))
    assert rel.counts() == {2}
    rel.finish()  # a no-op after a backward
    assert rel.steps == 2


@pytest.mark.parametrize("chain, words", [
    (lambda: pf.chain(pf.clip_by_global_norm(1.0), pf.adamw(1e-3)), ["chain[0] (clip_by_global_norm)", "global"]),
    (lambda: pf.chain(pf.zclip(), pf.lion(1e-4)), ["zclip", "global"]),
    (lambda: pf.accumulate(pf.adamw(1e-3), every=2), ["accumulate"]),
])
def test_refusals_name_the_cause(chain, words):
    with pytest.raises(InvalidArgument) as err:
        GradientRelease(chain(), tiny_model())
    for w in words:
        assert w in str(err.value)


def test_refuses_grad_accumulation_and_bad_arguments():
    model = tiny_model()
    with pytest.raises(InvalidArgument, match="grad_accum=4"):
        GradientRelease(pf.adamw(1e-3), model, grad_accum=4)
    with pytest.raises(InvalidArgument, match="master_weights"):
        GradientRelease(pf.adamw(1e-3), model, master_weights="fp16")
    with pytest.raises(InvalidArgument, match="plain chain"):
        GradientRelease(pf.compile(pf.adamw(1e-3)), model)
    with pytest.raises(InvalidArgument, match="Transform"):
        GradientRelease(torch.optim.SGD, model)


def test_state_dict_round_trip_resumes_exactly():
    data = batches(3)
    a, b = tiny_model(), tiny_model()
    run_release(a, CHAINS["adamw"](), data)  # the uninterrupted run
    rel = run_release(b, CHAINS["adamw"](), data[:2])
    saved = rel.state_dict()
    weights = {k: v.clone() for k, v in b.state_dict().items()}
    rel.remove()
    c = tiny_model(seed=5)
    c.load_state_dict(weights)
    resumed = GradientRelease(CHAINS["adamw"](), c)
    resumed.load_state_dict(saved)
    loss_of(c, data[2]).backward()
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(TreeMismatch, match="different"):
        GradientRelease(CHAINS["adamw"](), tiny_model(), groups="parameter").load_state_dict(saved)


def test_bf16_stochastic_rounding_trains_without_master():
    model = tiny_model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    rel = run_release(model, pf.lion(1e-4), batches(2), memory=pf.MemoryOptions(stochastic_rounding=True))
    assert rel.masters == {}
    # 1e-4 is below a bf16 ulp for most weights: round-to-nearest would freeze them
    moved = sum(int((p != q).sum()) for p, q in zip(model.parameters(), before))
    assert moved > 0 and all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_master_weights_fp32():
    model = tiny_model(torch.bfloat16)
    rel = run_release(model, pf.adamw(1e-3), batches(2), master_weights="fp32")
    assert set(rel.masters) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert rel.masters[n].dtype == torch.float32
        assert torch.equal(p, rel.masters[n].to(torch.bfloat16))
    mu = next(iter(rel.states.values()))["0_scale_by_adam"].mu
    assert all(x.dtype == torch.float32 for x in mu.values())
    d = rel.state_dict()
    assert any(k.startswith("__master__.") for k in d)
    other = tiny_model(torch.bfloat16, seed=3)
    again = GradientRelease(pf.adamw(1e-3), other, master_weights="fp32")
    again.load_state_dict(d)
    for n, p in other.named_parameters():
        assert torch.equal(again.masters[n], rel.masters[n]) and torch.equal(p, model.get_parameter(n))


def test_step_refuses_call_time_extras():
    rel = GradientRelease(CHAINS["adamw"](), tiny_model())
    with pytest.raises(InvalidArgument, match="GradientRelease.step: call-time extras"):
        rel.step(lr=1e-3)
    rel.step()  # nothing pending: a no-op


@pytest.mark.parametrize("groups", ["layer", "sublayer"])
def test_sublayer_groups_free_the_mlp_gradients_before_the_attention_recompute(groups):
    """Under ``"sublayer"`` checkpointing, backward recomputes a layer's attention half after its
    MLP half's backward: with ``"sublayer"`` release groups the MLP's weights have already stepped
    and their gradients are gone by then (what lowers the peak inside the attention's backward);
    with ``"layer"`` groups they are still waiting for the attention's gradients."""
    from pgs.runtime.model.layers import apply_activation_checkpointing

    model = tiny_model()
    apply_activation_checkpointing(model, "sublayer")
    layer = model.model.layers[1]
    seen = []

    def recompute(module, args, kwargs):
        if torch.is_grad_enabled():  # the recompute inside backward (forward runs without autograd)
            seen.append([p.grad is not None for p in layer.mlp.parameters()])

    handle = layer.self_attn.register_forward_pre_hook(recompute, with_kwargs=True)
    rel = run_release(model, CHAINS["adamw"](), batches(1), groups=groups)
    handle.remove()
    assert len(seen) == 1 and len(seen[0]) == 3 and rel.steps == 1
    assert seen[0] == ([False] * 3 if groups == "sublayer" else [True] * 3)
