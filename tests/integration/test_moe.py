"""Mixture-of-experts models through pgs (docs/moe.md): the router tap against transformers'
own router logits, the auxiliary losses' gradient against the global-batch loss, packing
isolation of Qwen3-MoE / OLMoE / Mixtral, and ``pgs run`` with telemetry (one process here;
2 gloo ranks under FSDP2 in tests/integration/test_moe_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from pgs.func.losses import load_balance_loss, router_stats, router_z_loss
from pgs.runtime.data.isolation import packing_isolation
from pgs.runtime.model.build import build_model, final_hidden
from pgs.runtime.model.moe import METRIC_KEYS, RouterTap, find_routers, router_tap
from pgs.runtime.spec.load import MoESpec
from helpers import cli_error, launch, run_here, step_records, tiny_spec

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=128, vocab_size=97, tie_word_embeddings=False)
#: Tiny random-init configurations of the three families (no downloads).
CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, **COMMON),
    "olmoe": dict(model_type="olmoe", intermediate_size=32, num_experts=4, num_experts_per_tok=2, **COMMON),
    "mixtral": dict(model_type="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    **COMMON),
}


def tiny(name: str, attn: str = "sdpa", dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(config=dict(CONFIGS[name]), dtype=dtype, attn_implementation=attn, init_seed=1)


class _Batch:
    """What the tap reads of a PackedBatch: input_ids, cu_seqlens (row lengths), num_tokens."""

    def __init__(self, ids: torch.Tensor, lengths: list[int]):
        self.input_ids = ids
        self.cu_seqlens = [torch.tensor([0, n], dtype=torch.int32) for n in lengths]
        self.num_tokens = sum(lengths)


def _batch(rows: int = 2, width: int = 12, lengths=(12, 7), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (rows, width), generator=gen)
    pos = torch.arange(width).repeat(rows, 1)
    for r, n in enumerate(lengths):
        pos[r, n:] = torch.arange(width - n)  # the padding: a document of its own
    return ids, pos, _Batch(ids, list(lengths))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_routers_found_and_stats_equal_transformers_router_logits(name):
    """The tap's sums over a forward equal router_stats of the logits transformers returns with
    output_router_logits=True, padding excluded."""
    model = tiny(name)
    routers = find_routers(model)
    assert [i for i, _, _ in routers] == [0, 1] and all(m.top_k == 2 for _, _, m in routers)
    tap = RouterTap(routers, telemetry=True)
    ids, pos, batch = _batch()
    tap.begin_step([batch], torch.device("cpu"))
    tap.begin_micro(batch, torch.device("cpu"))
    final_hidden(model, ids, pos)
    assert tap.end_micro() is None  # no auxiliary loss asked for
    values = tap.step_values()
    assert set(values) == set(METRIC_KEYS)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, output_router_logits=True).router_logits
    mask = torch.tensor([[t < n for t in range(12)] for n in (12, 7)]).reshape(-1)
    stats = [router_stats(x.reshape(-1, 4), 2, mask=mask) for x in logits]
    lb = torch.stack([load_balance_loss(s.counts, s.prob_sum, s.tokens, 2) for s in stats]).mean()
    z = torch.stack([router_z_loss(s.z_sum, s.tokens) for s in stats]).mean()
    torch.testing.assert_close(values["moe/lb_loss"], lb.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(values["moe/z_loss"], z.double(), rtol=1e-6, atol=1e-7)
    assert float(sum(s.tokens for s in stats)) == 2 * 19 and float(values["moe/tokens"]) == 19
    assert tap.step_values() == {}  # the window was consumed
    # eval / no-grad forwards outside begin_micro are not counted
    with torch.no_grad():
        final_hidden(model, ids, pos)
    assert tap.step_values() == {}
    tap.close()


def _global_loss(model, batches, k, lb, zc):
    """The reference: α·mean_l E Σ f P + β·mean_l mean_t lse², over all the batches at once."""
    logits = [[] for _ in range(2)]
    masks = []
    for ids, pos, b in batches:
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_router_logits=True).router_logits
        for j, x in enumerate(out):
            logits[j].append(x.reshape(-1, x.shape[-1]))
        masks.append(torch.tensor([[t < n for t in range(ids.shape[1])] for n in
                                   [int(c[-1]) for c in b.cu_seqlens]]).reshape(-1))
    mask = torch.cat(masks)
    total = 0
    for j in range(2):
        s = router_stats(torch.cat(logits[j]), k, mask=mask)
        total = total + (lb * load_balance_loss(s.counts, s.prob_sum, s.tokens, k) + zc * router_z_loss(s.z_sum, s.tokens)) / 2
    return total


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_aux_gradient_equals_global_batch_loss(name):
    """One micro-batch per step: the gradient the tap adds (its return / the loss denominator)
    equals the gradient of the global-batch load-balance + z-loss, computed from transformers'
    router logits.  Two micro-batches: the z-loss part and P are exact; f of the first
    micro-batch is its own (module docstring), so only the last micro-batch's term is exact."""
    model = tiny(name)
    lb, zc, denom = 0.3, 0.05, 37
    tap = RouterTap(find_routers(model), load_balance=lb, router_z_loss=zc)
    whole = _batch(rows=3, lengths=(12, 7, 10), seed=1)
    tap.begin_step([whole[2]], torch.device("cpu"), denom)
    tap.begin_micro(whole[2], torch.device("cpu"))
    final_hidden(model, whole[0], whole[1])
    aux = tap.end_micro()
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(aux / denom, params, allow_unused=True)
    ref = _global_loss(model, [whole], 2, lb, zc)
    theirs = torch.autograd.grad(ref, params, allow_unused=True)
    checked = 0
    for a, b in zip(ours, theirs):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        checked += float(b.abs().max()) > 0
    assert checked >= 2  # the routers' weights (and what feeds them) got a gradient
    values = tap.step_values()
    with torch.no_grad():
        torch.testing.assert_close(values["moe/lb_loss"] * lb + values["moe/z_loss"] * zc,
                                   _global_loss(model, [whole], 2, lb, zc).double(), rtol=1e-5, atol=1e-7)
    tap.close()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_isolation(name, attn):
    """Packed documents' final hidden states (and so logits) equal each document run alone:
    the routers are per token and attention is blocked at the restarts of position_ids."""
    model = tiny(name, attn)
    assert packing_isolation(model).isolates
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 97, (n,), generator=gen) for n in (5, 9, 4)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = final_hidden(model, ids, pos)[0]
        at = 0
        for d in docs:
            alone = final_hidden(model, d[None], torch.arange(len(d))[None])[0]
            torch.testing.assert_close(packed[at:at + len(d)], alone, rtol=1e-5, atol=1e-5)
            at += len(d)


def test_dense_model_and_refusals():
    dense = build_model(config=dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=97),
                        attn_implementation="sdpa")
    assert find_routers(dense) == [] and router_tap(dense, MoESpec()) is None
    from pgs.errors import SpecError

    with pytest.raises(SpecError, match="no mixture-of-experts router"):
        router_tap(dense, MoESpec(load_balance=0.01))
    with pytest.raises(SpecError, match="moe.load_balance"):
        MoESpec(load_balance=-1.0)


EXPERTS = {"qwen3_moe": "num_experts = 4\nmoe_intermediate_size = 16", "olmoe": "num_experts = 4",
           "mixtral": "num_local_experts = 4"}


def moe_spec(tmp_path, name, *, model_type="qwen3_moe", steps=3, grad_accum=2, checkpointing="none",
             load_balance=0.0, z_loss=0.0, **fields):
    """tests/helpers.py's tiny spec (``fields``: its other fields) with a 4-expert top-2 model of
    ``model_type`` and ``[moe]``."""
    path = tiny_spec(tmp_path, name, steps=steps, **{"every": 0, **fields})
    text = path.read_text().replace('model_type = "qwen3"',
                                    f'model_type = "{model_type}"\n{EXPERTS[model_type]}\nnum_experts_per_tok = 2')
    text = text.replace("grad_accum = 2", f"grad_accum = {grad_accum}")
    text += (f'\n[memory]\nactivation_checkpointing = "{checkpointing}"\n\n'
             f"[moe]\nload_balance = {load_balance}\nrouter_z_loss = {z_loss}\n")
    path.write_text(text)
    return path


def run_spec(path, child: bool = False):
    """The step records of ``pgs run path``: in this process (one thread), or ``child``: a child
    process (a run that compiles, which leaves dynamo's caches in the process that ran it)."""
    if child:
        done = launch(path, timeout=480)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert run_here(path) == 0
    return step_records(path.parent / path.stem)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["olmoe", "mixtral"])
def test_pgs_run_logs_router_telemetry(tmp_path, model_type):
    steps = run_spec(moe_spec(tmp_path, "run", model_type=model_type, steps=3))
    assert len(steps) == 3
    for r in steps:
        assert set(METRIC_KEYS) <= set(r)
        assert 0 < r["moe/utilization"] <= 1 and 0 <= r["moe/dead_frac"] <= 1
        assert r["moe/lb_loss"] >= 1 - 1e-9  # E Σ f P >= 1 ... for top-k routing f and P agree in order
        assert r["moe/max_vio_layer"] in (0.0, 1.0)


@pytest.mark.slow
def test_aux_losses_change_gradients_not_the_logged_loss(tmp_path):
    """With the router losses on (and activation checkpointing, which then recomputes through
    torch.utils.checkpoint), step 1's logged loss is the token loss alone, equal to a run
    without them; later steps differ (the routers' gradient changed); telemetry matches."""
    plain = run_spec(moe_spec(tmp_path, "plain"))
    aux = run_spec(moe_spec(tmp_path, "aux", checkpointing="full", load_balance=0.5, z_loss=0.1))
    assert plain[0]["loss"] == aux[0]["loss"]
    assert plain[0]["moe/lb_loss"] == pytest.approx(aux[0]["moe/lb_loss"], rel=1e-6)
    assert plain[-1]["loss"] != aux[-1]["loss"]
    assert plain[-1]["moe/z_loss"] != aux[-1]["moe/z_loss"]


@pytest.mark.slow
def test_router_telemetry_and_losses_through_compiled_layers(tmp_path):
    """``memory.compile_layers`` compiles each decoder layer, routers and their forward hooks
    inside: the telemetry and the router losses still reach the run (same step-1 loss and
    router statistics as the eager run, up to the compiled kernels' rounding)."""
    eager = run_spec(moe_spec(tmp_path, "eager", load_balance=0.2, z_loss=0.01))
    path = moe_spec(tmp_path, "compiled", load_balance=0.2, z_loss=0.01)
    path.write_text(path.read_text().replace("[memory]\n", "[memory]\ncompile_layers = true\n"))
    compiled = run_spec(path, child=True)
    assert "compile_layers = true" in (tmp_path / "compiled" / "spec.resolved.toml").read_text()
    assert len(compiled) == len(eager) == 3
    for key in METRIC_KEYS:
        assert compiled[0][key] == pytest.approx(eager[0][key], rel=1e-4, abs=1e-6), key
    assert compiled[0]["loss"] == pytest.approx(eager[0]["loss"], rel=1e-5)
    assert compiled[-1]["loss"] == pytest.approx(eager[-1]["loss"], rel=1e-3)


@pytest.mark.parametrize("fast", [True, False])
def test_checkpointed_recompute_is_not_counted_twice(fast):
    """A checkpointed layer's recompute in backward runs the routers again; the tap counts the
    forward only (both recompute paths), and with a router loss the gradient equals the
    unchecked model's."""
    from pgs.runtime.model.layers import apply_activation_checkpointing

    ids, pos, batch = _batch(seed=2)
    results = []
    for checkpointed in (False, True):
        model = tiny("qwen3_moe")
        if checkpointed:
            apply_activation_checkpointing(model, "full", fast_recompute=fast)
        tap = RouterTap(find_routers(model), load_balance=0.0 if fast else 0.2)
        tap.begin_step([batch], torch.device("cpu"), 10)
        tap.begin_micro(batch, torch.device("cpu"))
        h = final_hidden(model, ids, pos)
        aux = tap.end_micro()
        loss = h.square().mean() + (aux / 10 if aux is not None else 0)
        loss.backward()
        gate = find_routers(model)[0][2].weight.grad.clone()
        results.append((tap.step_values(), gate))
        tap.close()
    (plain, g0), (ckpt, g1) = results
    assert float(plain["moe/tokens"]) == float(ckpt["moe/tokens"]) == 19  # rows of 12 and 7 real tokens
    for key in METRIC_KEYS:
        torch.testing.assert_close(ckpt[key], plain[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)


def test_router_losses_refused_for_an_objective_that_does_not_feed_the_tap(tmp_path):
    """An objective whose forward does not feed the router tap ([preference], [distill]) takes no
    router loss: setup refuses it in one line naming the section, before the objective is built."""
    from pgs.errors import SpecError
    from pgs.runtime.loop.train import setup
    from pgs.runtime.spec.load import load_spec

    path = moe_spec(tmp_path, "pref", load_balance=0.01)
    text = path.read_text().replace('sources = [{ path = "pgs:quickstart/train.jsonl" }]',
                                    'sources = [{ path = "pgs:quickstart/pairs_train.jsonl" }]')
    text = text.replace('eval = "pgs:quickstart/eval.jsonl"', 'eval = "pgs:quickstart/pairs_eval.jsonl"')
    path.write_text(text + '\n[preference]\nkind = "dpo"\n')
    with pytest.raises(SpecError, match=r"a \[preference\] run takes no router loss"):
        setup(load_spec(str(path)))


IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_experts_implementation_is_the_one_built(name):
    """``model.experts_implementation`` reaches transformers: the built model runs its experts
    through the implementation asked for; ``"auto"`` is transformers' own default."""
    from transformers import AutoModelForCausalLM

    from pgs.runtime.model.build import build_config

    for impl in IMPLEMENTATIONS:
        model = build_model(config=dict(CONFIGS[name]), attn_implementation="sdpa", experts_implementation=impl)
        assert model.config._experts_implementation == impl
    auto = build_model(config=dict(CONFIGS[name]), attn_implementation="sdpa")
    own = AutoModelForCausalLM.from_config(build_config(dict(CONFIGS[name])), attn_implementation="sdpa")
    assert auto.config._experts_implementation == own.config._experts_implementation is not None


def test_experts_implementation_of_a_model_folder(tmp_path):
    """A local folder (``model.path``) loads with the implementation asked for, whatever its
    config.json says."""
    tiny("olmoe").save_pretrained(tmp_path / "olmoe")
    for impl in ("eager", "grouped_mm"):
        model = build_model(path=str(tmp_path / "olmoe"), attn_implementation="sdpa", experts_implementation=impl)
        assert model.config._experts_implementation == impl


def _loss_and_grads(model, ids, pos):
    from pgs.func.losses import token_loss
    from pgs.runtime.model.build import output_head

    h = final_hidden(model, ids, pos)
    W, bias, softcap = output_head(model)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    r = token_loss(h, W, labels, bias=bias, softcap=softcap, chunk_size=8)
    loss = r.loss_sum / r.num_valid
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_experts_implementations_give_equal_losses_and_gradients(name, monkeypatch):
    """eager (HF's loop over experts), grouped_mm and batched_mm: the same weights (same init
    seed) give the same loss and the same gradient of every parameter, the experts' stacked
    weights and the routers included, on a packed batch with padding.  On this CPU, grouped_mm
    runs torch's grouped GEMM itself (counted), not transformers' per-expert fallback."""
    ids, pos, _ = _batch(rows=2, width=12, lengths=(12, 7), seed=3)
    grouped_calls = []
    if hasattr(torch.nn.functional, "grouped_mm"):
        real = torch.nn.functional.grouped_mm
        monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                            lambda *a, **k: grouped_calls.append(1) or real(*a, **k))
    results = {}
    for impl in IMPLEMENTATIONS:
        model = build_model(config=dict(CONFIGS[name]), attn_implementation="sdpa", experts_implementation=impl,
                            init_seed=1)
        results[impl] = _loss_and_grads(model, ids, pos)
    loss, grads = results["eager"]
    experts = [n for n in grads if "experts" in n]
    assert experts and all(float(grads[n].abs().max()) > 0 for n in experts)
    for impl in ("grouped_mm", "batched_mm"):
        other_loss, other = results[impl]
        torch.testing.assert_close(other_loss, loss, rtol=1e-6, atol=1e-6)
        assert set(other) == set(grads)
        for n in grads:
            torch.testing.assert_close(other[n], grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{impl} {n}: {m}")
    if hasattr(torch.nn.functional, "grouped_mm"):
        assert grouped_calls  # 2 layers x 2 projections in forward at least


def test_experts_implementation_refusals(tmp_path, capsys):
    """An unknown name, and any implementation on a dense model, are refused in one line
    naming the field: by the spec, by the build, and by ``pgs validate`` (exit 2)."""
    from pgs.errors import SpecError
    from pgs.runtime.spec.load import ModelSpec

    with pytest.raises(SpecError, match=r"model.experts_implementation: 'fast' is not one of .*'grouped_mm'"):
        ModelSpec(experts_implementation="fast")
    dense = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=97)
    with pytest.raises(SpecError, match=r"model.experts_implementation: 'eager': Qwen3ForCausalLM has no "
                                        r"mixture-of-experts layers"):
        build_model(config=dense, attn_implementation="sdpa", experts_implementation="eager")
    assert build_model(config=dense, attn_implementation="sdpa", experts_implementation="auto").training  # no refusal
    path = tiny_spec(tmp_path, "dense")
    code, line = cli_error(["validate", str(path), "--set", "model.experts_implementation=grouped_mm"], capsys)
    assert code == 2
    assert "model.experts_implementation: 'grouped_mm': Qwen3ForCausalLM has no mixture-of-experts layers" in line


def test_pgs_run_setup_builds_the_spec_experts_implementation(tmp_path):
    """``model.experts_implementation`` in a spec reaches the model ``pgs run`` builds (its setup:
    preflight, build, [memory]): eager is not transformers' default, so it must come from the spec."""
    from pgs.runtime.loop.train import setup
    from pgs.runtime.spec.load import load_spec

    path = moe_spec(tmp_path, "olmoe", model_type="olmoe", grad_accum=1)
    for impl in ("eager", "grouped_mm"):
        spec = load_spec(str(path), [f"model.experts_implementation={impl}"])
        assert spec.model.experts_implementation == impl
        run = setup(spec)
        try:
            assert run.model.config._experts_implementation == impl
            assert type(run.model).__name__ == "OlmoeForCausalLM"
        finally:
            run.loader.close()


def _tap_ops(layers: int) -> dict[str, "collections.Counter"]:
    """The aten ops of a router tap's second step on a tiny OLMoE of ``layers`` layers, by the
    loop's call: ``hooks`` (the routers' forward hooks: the forward with the tap counting less
    the same forward without it), ``begin`` (begin_step + begin_micro), ``end_micro``,
    ``step_values``.  The first step fills the tap's caches."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(config=dict(CONFIGS["olmoe"], num_hidden_layers=layers), dtype=torch.float32,
                        attn_implementation="sdpa", init_seed=1)
    tap = RouterTap(find_routers(model))
    ids, pos, batch = _batch()
    cpu = torch.device("cpu")
    out = {}
    for step in range(2):
        with torch.no_grad(), Count() as plain:
            final_hidden(model, ids, pos)  # not counted by the tap (no begin_micro)
        with Count() as begin:
            tap.begin_step([batch], cpu)
            tap.begin_micro(batch, cpu)
        with torch.no_grad(), Count() as forward:
            final_hidden(model, ids, pos)
        with Count() as end:
            tap.end_micro()
        with Count() as values:
            tap.step_values()
        out = {"hooks": forward.ops - plain.ops, "begin": begin.ops, "end_micro": end.ops, "step_values": values.ops}
    tap.close()
    return out


def test_router_tap_reads_nothing_on_the_host_and_reduces_all_layers_at_once():
    """The telemetry adds no host read to a step (on a GPU each would wait for the device: a
    row's length, the worst layer's index, the layers' indices copied every step), runs a fixed
    number of ops per router in forward, and reduces the window with the same ops whatever the
    number of layers (one batched reduction, not one per layer)."""
    from test_release_launches import HOST_ONLY, SYNCS

    two, four = _tap_ops(2), _tap_ops(4)
    for part, ops in four.items():
        assert not SYNCS & set(ops), (part, ops)  # no .item() / int() / bool() of a tensor
    assert "lift_fresh" not in four["step_values"] + four["end_micro"], four  # no tensor from host numbers per step
    assert four["step_values"] == two["step_values"] and four["end_micro"] == two["end_micro"]
    per_router = {k: v / 2 for k, v in (four["hooks"] - two["hooks"]).items()}
    launching = sum(v for k, v in per_router.items() if k not in HOST_ONLY)
    # per router: the logits in fp32, log-softmax, entropy, the masked sums and one scatter_add
    # of the counts (before: a [T, E] one-hot, its mask product and sum, and the mask's cast)
    assert launching <= 18, per_router
    assert per_router.get("scatter_add_") == 1 and "zeros_like" not in per_router, per_router


def test_batched_load_balance_and_scattered_counts_equal_the_per_layer_forms():
    """One ``load_balance_loss`` call over stacked layers (``top_k`` a tensor, layers of
    different k) equals one call per layer, bit for bit; ``router_stats``' counts (one
    scatter_add of the tokens' mask) equal the masked one-hot sum."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (3, 8), generator=gen).double()
    prob_sum = torch.rand(3, 8, generator=gen, dtype=torch.float64) * 20
    tokens = torch.tensor([40.0, 33.0, 0.0], dtype=torch.float64)
    ks = [2, 3, 1]
    batched = load_balance_loss(counts, prob_sum, tokens, torch.tensor(ks))
    assert torch.equal(batched, torch.stack([load_balance_loss(counts[j], prob_sum[j], tokens[j], ks[j])
                                             for j in range(3)]))
    logits = torch.randn(30, 8, generator=gen)
    mask = torch.rand(30, generator=gen) > 0.3
    for m in (mask, None):
        s = router_stats(logits, 3, mask=m)
        top = torch.topk(logits, 3, dim=-1).indices
        onehot = torch.zeros(30, 8).scatter_add_(-1, top, torch.ones(30, 3))
        keep = torch.ones(30) if m is None else m.float()
        assert torch.equal(s.counts, (onehot * keep[:, None]).sum(0)) and float(s.counts.sum()) == 3 * float(keep.sum())
