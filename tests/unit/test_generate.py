"""pgs.runtime.model.generate: batched sampling with a KV cache, against transformers' generate.

A tiny random Qwen3 on the CPU.  Greedy decoding must give exactly what ``model.generate``
gives; a prompt's continuation must not depend on the prompts it is batched with; stop ids end
each row where they appear; seeded sampling is a function of the generator's state.
"""

from __future__ import annotations

import pytest
import torch

from pgs.errors import InvalidArgument
from pgs.runtime.model.build import build_model
from pgs.runtime.model.generate import GenerationSettings, generate, next_token
from tiny import shape_table

V = 97
CONFIG = shape_table(max_position_embeddings=128, vocab_size=V, tie_word_embeddings=True)
PAD = 0


@pytest.fixture(scope="module")
def model():
    m = build_model(config=CONFIG, dtype="float32", attn_implementation="sdpa", init_seed=3)
    with torch.no_grad():  # sharpen the random head so that greedy choices are not near-ties
        m.get_output_embeddings().weight.mul_(8.0)
    return m


def prompts(seed=0, n=5, lo=2, hi=12):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, V, (k,), generator=g).tolist() for k in lens]


def hf_greedy(model, ps, max_new, stop):
    from pgs.runtime.model.generate import left_pad

    ids, mask = left_pad(ps, PAD)
    out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=stop, pad_token_id=PAD)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_equals_transformers_generate(model, cache):
    ps = prompts(0)
    got = generate(model, ps, GenerationSettings(max_new_tokens=10, temperature=0), stop_ids=[], pad_id=PAD,
                   cache=cache, compile=False)
    ref = hf_greedy(model, ps, 10, None)
    assert torch.equal(got.completion_ids, ref)
    assert got.lengths.tolist() == [10] * len(ps) and got.generated_tokens == 10 * len(ps)
    assert got.completion_mask.all() and model.training  # put back in training mode


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_equals_recomputing_every_prefix_without_a_cache(cache):
    """The cache is really used: greedy tokens equal the argmax of a full forward of each prefix
    (no cache at all), whatever the installed transformers calls the forward's cache argument.
    An untied head (the tied, sharpened fixture mostly repeats the last token, which a forward
    that ignored its cache would reproduce too)."""
    model = build_model(config={**CONFIG, "tie_word_embeddings": False}, dtype="float32", attn_implementation="sdpa",
                        init_seed=5)
    ps = prompts(6, n=3)
    got = generate(model, ps, GenerationSettings(max_new_tokens=6, temperature=0), stop_ids=[], pad_id=PAD,
                   cache=cache, compile=False)
    with torch.no_grad():
        for p, row in zip(ps, got.completion_ids.tolist()):
            seq = list(p)
            for _ in range(6):
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                seq.append(int(logits.argmax()))
            assert row == seq[len(p):]


def test_stop_ids_end_each_row_as_transformers_does(model):
    ps = prompts(1, n=6)
    free = generate(model, ps, GenerationSettings(max_new_tokens=12, temperature=0), stop_ids=[], pad_id=PAD)
    # stop at tokens the free run produces at different steps, so rows stop at different lengths
    stops = sorted({free.completion_ids[0, 3].item(), free.completion_ids[1, 6].item()})
    got = generate(model, ps, GenerationSettings(max_new_tokens=12, temperature=0), stop_ids=stops, pad_id=PAD)
    ref = hf_greedy(model, ps, 12, stops)
    T = got.completion_ids.shape[1]
    assert torch.equal(got.completion_ids, ref[:, :T]) and (ref[:, T:] == PAD).all()
    for row, n, free_row in zip(got.completion_ids.tolist(), got.lengths.tolist(), free.completion_ids.tolist()):
        first = next((i for i, t in enumerate(free_row) if t in stops), None)
        assert n == (12 if first is None else first + 1)  # the stop token is part of the completion
        assert row[:n] == free_row[:n] and all(t == PAD for t in row[n:])
    assert got.lengths.min() < 12
    assert got.completion_mask.sum(1).tolist() == got.lengths.tolist()


def test_a_prompt_batched_with_longer_ones_continues_as_alone(model):
    short = prompts(2, n=1, lo=2, hi=3)
    longer = prompts(3, n=3, lo=14, hi=20)
    settings = GenerationSettings(max_new_tokens=8, temperature=0)
    alone = generate(model, short, settings, stop_ids=[], pad_id=PAD)
    batched = generate(model, longer + short, settings, stop_ids=[], pad_id=PAD)
    assert batched.prompt_mask[-1].sum() == len(short[0]) and not batched.prompt_mask[-1, 0]
    assert torch.equal(batched.completion_ids[-1], alone.completion_ids[0])
    split = generate(model, longer + short, settings, stop_ids=[], pad_id=PAD, batch_size=2)
    assert torch.equal(split.completion_ids, batched.completion_ids)


def test_seeded_sampling_reproducible_and_resumable(model):
    ps = prompts(4)
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, top_p=0.9)
    g = torch.Generator().manual_seed(11)
    a1 = generate(model, ps, settings, stop_ids=[5], pad_id=PAD, generator=g)
    saved = g.get_state()
    a2 = generate(model, ps, settings, stop_ids=[5], pad_id=PAD, generator=g)
    again = torch.Generator().manual_seed(11)
    assert torch.equal(generate(model, ps, settings, stop_ids=[5], pad_id=PAD, generator=again).completion_ids,
                       a1.completion_ids)
    resumed = torch.Generator()
    resumed.set_state(saved)  # a checkpoint's sampler state: the next call is what the run drew
    assert torch.equal(generate(model, ps, settings, stop_ids=[5], pad_id=PAD, generator=resumed).completion_ids,
                       a2.completion_ids)
    assert not torch.equal(a1.completion_ids, a2.completion_ids)


def test_sampling_follows_the_distribution_and_top_p_cuts_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    g = torch.Generator().manual_seed(0)
    draws = next_token(logits, GenerationSettings(temperature=1.0), g)
    freq = torch.bincount(draws, minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=0.03, rtol=0)
    nucleus = next_token(logits, GenerationSettings(temperature=1.0, top_p=0.8), g)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.8: the rest is cut
    freq = torch.bincount(nucleus, minlength=4).double() / 4000
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375], dtype=torch.float64), atol=0.03, rtol=0)
    assert next_token(logits[:1], GenerationSettings(temperature=0), None).item() == 0


@pytest.mark.parametrize("kw, word", [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_settings_name_the_field(kw, word):
    with pytest.raises(InvalidArgument, match=word):
        GenerationSettings(**kw)


def test_sampling_without_a_generator_is_refused(model):
    with pytest.raises(InvalidArgument, match="generator"):
        generate(model, prompts(0), GenerationSettings(temperature=1.0), stop_ids=[], pad_id=PAD)
    with pytest.raises(InvalidArgument, match=r"prompts\[1\]"):
        generate(model, [[1], []], GenerationSettings(temperature=0), stop_ids=[], pad_id=PAD)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_compiled_decode_on_cuda_equals_dynamic(model):
    m = build_model(config=CONFIG, dtype="float32", attn_implementation="sdpa", init_seed=3, device="cuda")
    ps = prompts(5)
    s = GenerationSettings(max_new_tokens=10, temperature=0)
    fast = generate(m, ps, s, stop_ids=[7], pad_id=PAD)  # auto: static cache, compiled step, CUDA graph
    slow = generate(m, ps, s, stop_ids=[7], pad_id=PAD, cache="dynamic", compile=False)
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    # rows that stop at different tokens, all before the cap: the loop asks only every few tokens
    # whether all stopped, and the completions still end at the longest one
    long = GenerationSettings(max_new_tokens=60, temperature=0)
    stops = sorted(set(slow.completion_ids[:, :3].flatten().tolist()) - {PAD})
    fast = generate(m, ps, long, stop_ids=stops, pad_id=PAD)
    slow = generate(m, ps, long, stop_ids=stops, pad_id=PAD, cache="dynamic", compile=False)
    assert torch.equal(fast.lengths, slow.lengths) and int(slow.lengths.max()) < 60
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert fast.completion_ids.shape[1] == int(slow.lengths.max())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decode_over_many_calls_and_widths_equals_eager(model):
    """Each batch captures its own CUDA graph of the compiled step: calls at a dozen prompt widths
    (more than dynamo's recompile limit) and repeated widths all give the eager completions, and
    the capture held (no fallback)."""
    m = build_model(config=CONFIG, dtype="float32", attn_implementation="sdpa", init_seed=3, device="cuda")
    s = GenerationSettings(max_new_tokens=12, temperature=0)
    for i, hi in enumerate([4, 12, 70, 12, 130, 200, 260, 330, 390, 450, 520, 580, 70, 4]):
        ps = prompts(20 + i, n=3, lo=max(2, hi // 2), hi=hi + 1)
        fast = generate(m, ps, s, stop_ids=[], pad_id=PAD)
        slow = generate(m, ps, s, stop_ids=[], pad_id=PAD, cache="dynamic", compile=False)
        assert torch.equal(fast.completion_ids, slow.completion_ids), hi
    from pgs.runtime.model.generate import _LAST_GRAPH, _NO_GRAPH

    assert m in _LAST_GRAPH and m not in _NO_GRAPH  # every batch was captured


def test_compiled_decode_takes_every_width_with_two_compilations(model):
    """The compiled step's second width makes the width symbolic: prompts of ten widths (past
    dynamo's recompile limit of 8, where a step compiled per width would fall back to running
    uncompiled) compile twice in all, and decode as the eager step does."""
    from torch._dynamo.utils import counters

    m = build_model(config=CONFIG, dtype="float32", attn_implementation="sdpa", init_seed=3)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(8.0)
    s = GenerationSettings(max_new_tokens=4, temperature=0)
    counters.clear()
    for i, hi in enumerate([3, 70, 130, 200, 260, 330, 390, 450, 520, 580, 3]):
        ps = prompts(40 + i, n=2, lo=max(2, hi - 5), hi=hi + 1)
        fast = generate(m, ps, s, stop_ids=[], pad_id=PAD, cache="static", compile=True)
        slow = generate(m, ps, s, stop_ids=[], pad_id=PAD, cache="static", compile=False)
        assert torch.equal(fast.completion_ids, slow.completion_ids), hi
    assert counters["stats"]["unique_graphs"] == 2


def test_layers_compiled_for_training_are_not_recompiled_by_generation():
    """``memory.compile_layers`` compiles each decoder layer for the training forward; the prefill
    and the uncompiled decode steps run them as written (a cache makes each layer's index a
    constant of its graph: one recompile per layer otherwise), and the completions are the
    uncompiled model's."""
    from torch._dynamo.utils import counters

    from pgs.runtime.model.layers import compile_layers

    config = {**CONFIG, "tie_word_embeddings": False, "num_hidden_layers": 3}
    plain = build_model(config=config, dtype="float32", attn_implementation="sdpa", init_seed=5)
    m = build_model(config=config, dtype="float32", attn_implementation="sdpa", init_seed=5)
    assert compile_layers(m, backend="eager") == 3
    m(input_ids=torch.randint(1, V, (2, 16)), use_cache=False).logits.sum().backward()  # the training graph
    ps, s = prompts(7, n=3), GenerationSettings(max_new_tokens=5, temperature=0)
    counters.clear()
    for cache in ("dynamic", "static"):
        got = generate(m, ps, s, stop_ids=[], pad_id=PAD, cache=cache, compile=False)
        ref = generate(plain, ps, s, stop_ids=[], pad_id=PAD, cache=cache, compile=False)
        assert torch.equal(got.completion_ids, ref.completion_ids)
    assert not counters["stats"].get("unique_graphs")  # nothing compiled after the training forward


def test_a_batch_shared_over_processes_samples_what_one_process_does(model):
    """``Share``: each (simulated) process samples its rows of one global batch, interleaved and
    one of them empty; every row's completion and every generator's final state equal one
    process sampling the whole batch.  The agreement that all rows stopped is simulated from the
    whole batch's longest completion (the CPU checks after every decode step)."""
    from pgs.runtime.model.generate import Share

    ps = prompts(7, n=6, lo=2, hi=14)
    settings = GenerationSettings(max_new_tokens=10, temperature=1.0, top_p=0.9)
    whole_gen = torch.Generator().manual_seed(5)
    whole = generate(model, ps, settings, stop_ids=[5, 9, 17], pad_id=PAD, generator=whole_gen)
    assert whole.lengths.min() < whole.lengths.max()  # rows stop at different steps
    width, longest = max(len(p) for p in ps), int(whole.lengths.max())
    for rows in [(4, 0, 2), (1, 3, 5), ()]:
        checks = []

        def all_stopped(mine: bool) -> bool:
            checks.append(mine)
            return len(checks) >= longest

        g = torch.Generator().manual_seed(5)
        part = generate(model, [ps[i] for i in rows], settings, stop_ids=[5, 9, 17], pad_id=PAD, generator=g,
                        share=Share(rows, len(ps), width, all_stopped))
        assert part.completions() == [whole.completions()[i] for i in rows]
        assert torch.equal(g.get_state(), whole_gen.get_state())
        assert part.generated_tokens == sum(int(whole.lengths[i]) for i in rows)
    with pytest.raises(InvalidArgument, match="share: 1 rows for 2 prompts"):
        generate(model, ps[:2], settings, stop_ids=[], pad_id=PAD, generator=g,
                 share=Share((0,), 6, width, lambda mine: mine))
