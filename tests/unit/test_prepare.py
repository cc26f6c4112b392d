"""``pgs prepare``: the scores (HES, per-token NLL / entropy), scoring and its resume, the
selection rules' invariants, TFP order, verifiers and the self-answer pipeline (CPU, tiny model)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pgs.errors import DataError, InvalidArgument, SpecError
from pgs.func.data_scores import HES_RHO, hes, hes_k, tfp_order
from pgs.func.losses import token_nll_entropy
from pgs.runtime.prepare import score as S, select as sel
from pgs.runtime.prepare import self_answer as sa
from pgs.runtime.prepare.verify import make_verifier, parse_answer
from helpers import QUICKSTART, model_toml

TINY = model_toml(num_hidden_layers=1) + """
[data]
sources = [{ path = "DATA" }]
max_seq_len = 120
truncation = "drop"
seed = 1

[train]
steps = 1
batch_size = 1
device = "cpu"

[checkpoint]
dir = "RUN"
"""


def _records(n: int, tail_long: bool = True) -> list[str]:
    lines = (QUICKSTART / "train.jsonl").read_text().splitlines()[:n]
    if tail_long:  # one record longer than max_seq_len: scored as dropped, never silently lost
        long = {"messages": [{"role": "user", "content": "x " * 120}, {"role": "assistant", "content": "y"}]}
        lines.append(json.dumps(long))
    return lines


@pytest.fixture
def tiny(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(_records(30)) + "\n")
    path = tmp_path / "spec.toml"
    path.write_text(TINY.replace("DATA", str(data)).replace("RUN", str(tmp_path / "run")))
    from pgs.runtime.spec.load import load_spec

    return load_spec(path)


# --------------------------------------------------------------------------- HES (docs/techniques/hes.md)

entropy_lists = st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), min_size=1, max_size=600)


@given(entropy_lists)
@settings(max_examples=60, deadline=None)
def test_hes_invariants(values):
    h = torch.tensor(values, dtype=torch.float64)
    k = hes_k(len(values))
    value = hes(h)
    assert value >= 0
    assert value <= k * 10 + 1e-9
    assert value == pytest.approx(hes(h.flip(0)))  # order-invariant
    assert value == pytest.approx(sorted(values, reverse=True)[:k] and sum(sorted(values, reverse=True)[:k]))
    raised = h.clone()
    raised[len(values) // 2] += 1.0
    assert hes(raised) >= value  # raising one H_t never lowers HES
    if len(values) <= 200:
        assert k == 1 and value == pytest.approx(max(values))


def test_hes_k_is_the_ceiling_of_half_a_percent_and_non_decreasing():
    assert [hes_k(t) for t in (0, 1, 200, 201, 400, 401, 1000)] == [0, 1, 1, 2, 2, 3, 5]
    ks = [hes_k(t) for t in range(0, 5000)]
    assert all(a <= b for a, b in zip(ks, ks[1:]))
    assert hes(torch.zeros(0)) == 0.0
    with pytest.raises(InvalidArgument):
        hes(torch.zeros(2, 2))


def test_hes_is_at_most_k_log_v_for_real_distributions():
    torch.manual_seed(0)
    z = torch.randn(500, 37)
    p = torch.softmax(z, -1)
    entropy = -(p * p.log()).sum(-1)
    assert hes(entropy) <= hes_k(500) * math.log(37) + 1e-9


# --------------------------------------------------------------------------- per-token NLL / entropy


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_token_nll_entropy_equals_the_dense_reference(softcap):
    torch.manual_seed(1)
    h, W, b = torch.randn(3, 7, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    z = h @ W.T + b
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    want_nll = -logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    mask = labels != -100
    for chunk in (1, 4, 1024):
        nll, entropy = token_nll_entropy(h, W, labels, bias=b, softcap=softcap, chunk_size=chunk)
        torch.testing.assert_close(nll[mask], want_nll[mask])
        torch.testing.assert_close(entropy[mask], want_entropy[mask])
        assert (nll[~mask] == 0).all() and (entropy[~mask] == 0).all()


# --------------------------------------------------------------------------- scoring


def test_scores_match_the_training_tokens_and_dropped_records_are_listed(tiny, tmp_path):
    out = tmp_path / "prep"
    counts = S.score(tiny, str(out), batch_size=8)
    assert counts["complete"] and counts["scored"] == 31
    scores = S.read_scores(str(out / S.SCORES))
    assert [s["id"] for s in scores] == [f"0:{i}" for i in range(31)]
    dropped = [s for s in scores if not s["kept"]]
    assert [(s["id"], s["reason"]) for s in dropped] == [("0:30", "too_long")]
    # one sample scored by hand: the document training builds, the dense loss over its trained targets
    model, tokenizer = S.load_model(tiny, torch.device("cpu"))
    from pgs.runtime.data import DataStats, read_conversations
    from pgs.runtime.data.stream import encode_document

    conversation = next(iter(read_conversations(tiny.data.sources[0].path)))
    doc = encode_document(conversation, tokenizer, tiny.data, DataStats())
    ids = torch.tensor([doc.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    labels = torch.tensor(doc.labels())
    m = labels != -100
    logp = torch.log_softmax(logits, -1)
    nll = -logp[m].gather(-1, labels[m][:, None]).squeeze(-1)
    entropy = -(logp[m].exp() * logp[m]).sum(-1)
    first = scores[0]
    assert first["trained"] == int(m.sum()) == doc.num_trained
    assert first["tokens"] == len(doc)
    assert first["nll"] == pytest.approx(float(nll.mean()), rel=1e-4)
    assert first["entropy"] == pytest.approx(float(entropy.mean()), rel=1e-4)
    assert first["hes"] == pytest.approx(float(entropy.max()), rel=1e-4)


def test_scoring_resumes_after_a_kill_and_skips_what_is_scored(tiny, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    S.score(tiny, str(full), batch_size=4)
    first = S.score(tiny, str(part), batch_size=4, stop_after=2)
    assert not first["complete"] and first["scored"] == 8
    with open(part / S.SCORES, "a") as handle:  # a kill in the middle of a write
        handle.write('{"id": "0:8", "sou')
    second = S.score(tiny, str(part), batch_size=4)
    assert second["resumed"] == 8 and second["scored"] == 31 - 8
    a, b = S.read_scores(str(full / S.SCORES)), S.read_scores(str(part / S.SCORES))
    assert [s["id"] for s in b] == [s["id"] for s in a]  # each once, in order
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == (pytest.approx(y[key], rel=1e-5) if isinstance(x[key], float) else y[key])


def test_scoring_refuses_a_folder_scored_with_another_spec(tiny, tmp_path):
    import attrs

    out = tmp_path / "prep"
    S.score(tiny, str(out), batch_size=16, stop_after=1)
    other = attrs.evolve(tiny, data=attrs.evolve(tiny.data, max_seq_len=100))
    with pytest.raises(SpecError, match="different data"):
        S.score(other, str(out))


# --------------------------------------------------------------------------- selection


def _fake_scores(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"{i % 2}:{i // 2}", "kept": True, "nll": float(rng.gamma(2.0)), "hes": float(rng.random() * 5),
             "tokens": int(rng.integers(10, 100)), "trained": 5, "entropy": 1.0} for i in range(n)]


def test_random_subset_is_a_deterministic_subset_of_the_asked_size():
    scores = _fake_scores(200)
    a = sel.random_subset(scores, 50, seed=3)
    assert len(a) == len(set(a)) == 50 and set(a) <= {s["id"] for s in scores}
    assert a == sel.random_subset(scores, 50, seed=3)
    assert a != sel.random_subset(scores, 50, seed=4)
    assert len(sel.random_subset(scores, 500, seed=3)) == 200


def test_outlier_drop_removes_exactly_the_far_samples():
    scores = _fake_scores(300)
    scores[5]["tokens"] = 10_000
    scores[9]["nll"] = 500.0
    keep, dropped = sel.drop_outliers(scores, z=3.0)
    kept = {s["id"] for s in scores if s["id"] in set(keep)}
    assert scores[5]["id"] not in kept and scores[9]["id"] not in kept
    tokens = np.array([s["tokens"] for s in scores], float)
    nll = np.array([s["nll"] for s in scores], float)
    far = (np.abs(sel.zscores(tokens)) > 3) | (np.abs(sel.zscores(nll)) > 3)
    assert kept == {s["id"] for s, f in zip(scores, far) if not f}
    assert dropped["length"] + dropped["nll"] == int(far.sum())


@pytest.mark.parametrize("n", [40, 100, 37])
def test_jshape_takes_20_50_25_5_percent_from_the_familiarity_quartiles(n):
    scores = _fake_scores(400)
    chosen = set(sel.jshape(scores, n, seed=1))
    bins = sel.quartiles(scores)
    assert [len(b) for b in bins] == [100] * 4
    edges = [max(next(s["nll"] for s in scores if s["id"] == i) for i in b) for b in bins]
    assert edges == sorted(edges)  # easiest (lowest NLL) first
    taken = [len(chosen & set(b)) for b in bins]
    assert sum(taken) == len(chosen) == n
    assert taken == sel.quotas(n, sel.JSHAPE_SHARES, [100] * 4)
    assert all(abs(t - n * share) <= 1 for t, share in zip(taken, sel.JSHAPE_SHARES))
    assert sel.jshape(scores, n, seed=1) == sel.jshape(scores, n, seed=1)


def test_quotas_hand_what_a_small_bin_cannot_give_to_the_others():
    # 20/50/25/5 of 100; the second bin holds 10, its other 40 go 20:25:5 to the rest (16, 20, 4)
    assert sel.quotas(100, sel.JSHAPE_SHARES, [100, 10, 100, 100]) == [36, 10, 45, 9]
    got = sel.quotas(50, sel.JSHAPE_SHARES, [3, 4, 5, 100])
    assert sum(got) == 50 and got[:3] == [3, 4, 5]
    assert sel.quotas(1000, sel.JSHAPE_SHARES, [3, 4, 5, 6]) == [3, 4, 5, 6]


def test_top_hes_keeps_the_highest_scores():
    scores = _fake_scores(100)
    chosen = set(sel.top_hes(scores, 20))
    low = min(s["hes"] for s in scores if s["id"] in chosen)
    assert len(chosen) == 20 and all(s["hes"] <= low for s in scores if s["id"] not in chosen)


def test_select_pairs_every_rule_with_a_random_baseline_of_the_same_size():
    scores = _fake_scores(300) + [{"id": "0:999", "kept": False, "reason": "too_long"}]
    for rule, kwargs in [("random", {"size": 30}), ("jshape", {"fraction": 0.2}), ("hes", {}),
                         ("outliers", {}), ("jshape", {"size": 40, "outlier_z": 2.0})]:
        result = sel.select(scores, rule, seed=5, **kwargs)
        assert len(result["random"]) == len(result["selected"]) > 0
        assert "0:999" not in result["selected"] and "0:999" not in result["random"]
        assert result == sel.select(scores, rule, seed=5, **kwargs)
    assert len(sel.select(scores, "hes")["selected"]) == 60
    with pytest.raises(SpecError, match="--size or --fraction"):
        sel.select(scores, "jshape")


def test_written_selection_is_the_source_lines_verbatim(tiny, tmp_path):
    lines = Path(tiny.data.sources[0].path).read_text().splitlines()
    path = tmp_path / "sel.jsonl"
    assert sel.write_selection(tiny, ["0:7", "0:2", "0:30"], str(path)) == 3
    assert path.read_text().splitlines() == [lines[2], lines[7], lines[30]]
    sel.write_selection(tiny, ["0:7", "0:2"], str(path), keep_order=True)
    assert path.read_text().splitlines() == [lines[7], lines[2]]


# --------------------------------------------------------------------------- TFP (docs/techniques/tfp.md)


def _greedy_path(x: torch.Tensor) -> list[int]:
    path, left = [0], set(range(1, len(x)))
    while left:
        cur = x[path[-1]]
        nxt = min(left, key=lambda j: (float(torch.dist(cur, x[j])), j))
        path.append(nxt)
        left.remove(nxt)
    return path


@given(st.integers(1, 25), st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_tfp_is_a_permutation_and_threshold_zero_is_the_greedy_path(n, seed):
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    order = tfp_order(x)
    assert sorted(order) == list(range(n))
    assert order == _greedy_path(x)
    assert tfp_order(x, threshold=0.5, window=2) == tfp_order(x, threshold=0.5, window=2)


def test_tfp_skips_near_duplicates_of_the_recent_samples():
    # two near-duplicates of sample 0 and far ones: with a threshold, the path leaves them for later
    x = torch.tensor([[0.0, 0], [0.01, 0], [0.02, 0], [1.0, 0], [2.0, 0], [3.0, 0]])
    assert tfp_order(x) == [0, 1, 2, 3, 4, 5]
    order = tfp_order(x, threshold=0.5)
    assert order[1] == 3 and sorted(order) == list(range(6))
    for a, b in zip(order, order[1:]):
        passing = any(float(torch.dist(x[a], x[j])) > 0.5 for j in range(6) if j not in order[:order.index(b)])
        if passing:
            assert float(torch.dist(x[a], x[b])) > 0.5


# --------------------------------------------------------------------------- verifiers


def test_builtin_verifiers():
    ref = {"role": "assistant", "content": "105"}
    ans = lambda text: parse_answer(text, "<|im_end|>")  # noqa: E731
    assert make_verifier("exact")(ans(" 105 <|im_end|>junk"), ref, {})
    assert not make_verifier("exact")(ans("104<|im_end|>"), ref, {})
    assert make_verifier("number")(ans("The total is 1,234.<|im_end|>"), {"content": "1234"}, {})
    assert not make_verifier("number")(ans("The answer is 104<|im_end|>"), ref, {})
    assert make_verifier("number")(ans("so 47 + 58 = 105.0<|im_end|>"), ref, {})
    assert not make_verifier("number")(ans("no number<|im_end|>"), ref, {})
    assert make_verifier("regex:^\\d+$")(ans("105<|im_end|>"), ref, {})
    assert not make_verifier("regex:^\\d+$")(ans("x105<|im_end|>"), ref, {})
    assert make_verifier("json")(ans('```json\n{"a": 1}\n```'), ref, {})
    assert not make_verifier("json")(ans('{"a": 1'), ref, {})
    tools = {"tools": [{"type": "function", "function": {"name": "get_weather",
                        "parameters": {"required": ["city"]}}}]}
    call = ans('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>')
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert make_verifier("tool_call")(call, ref, tools)
    assert not make_verifier("tool_call")(ans('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'), ref, tools)
    assert not make_verifier("tool_call")(ans('<tool_call>{"name": "other", "arguments": {"city": "x"}}</tool_call>'), ref, tools)
    assert not make_verifier("tool_call")(ans('<tool_call>{"name": broken</tool_call>'), ref, tools)
    expected = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert make_verifier("exact")(call, expected, tools)


def test_user_verifier_runs_the_named_function_and_bad_names_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(
        "def even(answer, reference, record):\n    return int(answer['content']) % 2 == 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    verify = make_verifier("my_checks:even")
    assert verify({"content": "4"}, {}, {}) and not verify({"content": "3"}, {}, {})
    for name, match in [("nope_module_xyz:f", "cannot import"), ("my_checks:missing", "no function"),
                        ("fuzzy", "not one of"), ("regex:(", "not a regular expression")]:
        with pytest.raises(SpecError, match=match):
            make_verifier(name)


# --------------------------------------------------------------------------- self-answers


class _Tok:
    eos_token = "<|im_end|>"


def test_self_answer_keeps_the_first_finished_accepted_answer_and_counts_the_rest():
    records = [(json.loads(line), f"f:{i + 1}") for i, line in enumerate(_records(6, tail_long=False))]
    seen = {}

    def generate(model, tokenizer, prompts, k, **options):
        seen["prompts"], seen["k"] = prompts, k
        out = []
        for messages, tools in prompts:
            if messages[-1]["role"] == "tool":  # the weather relay: answer it right
                want = messages[0]["content"].split(" in ")[1].rstrip("?") + ": " + messages[-1]["content"] + "."
            else:
                a, b = (int(x) for x in messages[-1]["content"][8:-1].split(" + "))
                want = str(a + b)
            out.append(["999<|im_end|>", want, want + "<|im_end|>", want + "<|im_end|>"])  # wrong, unfinished, right x2
        return out

    kept, dataset, stats = sa.self_answer(None, _Tok(), records, make_verifier("exact"), k=4, generate=generate)
    assert dataset == [r for r, _ in records]
    assert seen["k"] == 4 and len(seen["prompts"]) == 6
    assert all(m["role"] != "assistant" or i < len(p) for p, _ in seen["prompts"] for i, m in enumerate(p))
    assert stats == {"prompts": 6, "answers": 24, "finished": 18, "accepted": 12, "kept": 6}
    for (record, origin), out in zip(records, kept):
        assert out["messages"] == record["messages"] and out["task"] == record["task"]
        assert out["self_answer"] == {"origin": origin, "sample": 2}
        from pgs.runtime.data.records import parse_record

        parse_record(out)  # a valid training record


def test_replay_marks_and_counts_general_prompts():
    records = [(json.loads(line), f"g:{i + 1}") for i, line in enumerate(_records(10, tail_long=False))]
    generate = lambda model, tok, prompts, k, **o: [["general reply<|im_end|>"] if i % 3 else ["cut off"]  # noqa: E731
                                                     for i in range(len(prompts))]
    kept, stats = sa.replay(None, _Tok(), records, 4, generate=generate)
    assert len(kept) == 4 == stats["replay_kept"] and all(r["replay"] for r in kept)
    assert all(r["messages"][-1]["content"] == "general reply" for r in kept)
    assert sa.replay_count(30, 0.25) == 10
    with pytest.raises(SpecError):
        sa.replay_count(30, 1.0)


def test_generate_answers_with_the_tiny_model_is_seeded_and_shaped(tiny):
    from pgs.runtime.prepare.generation import generate_answers

    model, tokenizer = S.load_model(tiny, torch.device("cpu"))
    prompts = [([{"role": "user", "content": "What is 1 + 2?"}], None), ([{"role": "user", "content": "Hi"}], None)]
    a = generate_answers(model, tokenizer, prompts, 3, max_new_tokens=4, seed=1)
    assert len(a) == 2 and all(len(x) == 3 for x in a)
    assert a == generate_answers(model, tokenizer, prompts, 3, max_new_tokens=4, seed=1)
    greedy = generate_answers(model, tokenizer, prompts, 2, temperature=0, max_new_tokens=4)
    assert all(x[0] == x[1] for x in greedy)


# --------------------------------------------------------------------------- the command


def test_pgs_prepare_scores_reports_selects_and_self_answers(tiny, tmp_path, capsys):
    from pgs.cli import main

    spec_path = Path(tiny.source) if tiny.source else tmp_path / "spec.toml"
    out = tmp_path / "prep"
    code = main(["prepare", str(tmp_path / "spec.toml"), "--out", str(out), "--select", "jshape", "--size", "12",
                 "--batch-size", "8"])
    assert code == 0
    assert (out / "report" / "summary.md").exists() and (out / "report" / "hist_nll.png").exists()
    selected = (out / "selected.jsonl").read_text().splitlines()
    baseline = (out / "random.jsonl").read_text().splitlines()
    assert len(selected) == len(baseline) == 12
    assert json.loads((out / "selection.json").read_text())["rule"] == "jshape"
    code = main(["prepare", str(tmp_path / "spec.toml"), "--out", str(out), "--self-answer", "--verify", "exact",
                 "-k", "2", "--max-new-tokens", "3", "--limit", "4", "--order", "tfp"])
    assert code == 0
    stats = json.loads((out / "self_answers.json").read_text())
    assert stats["prompts"] == 4 and stats["answers"] == 8
    assert len((out / "dataset_answers.jsonl").read_text().splitlines()) == stats["kept"]
    assert len((out / "ordered.jsonl").read_text().splitlines()) == 30
    assert main(["prepare", str(tmp_path / "spec.toml"), "--out", str(out), "--self-answer"]) == 2
    assert "--verify is needed" in capsys.readouterr().err
    del spec_path
