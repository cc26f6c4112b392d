"""KTO's unpaired records (``kind = "kto"``): the three record shapes, every bad record's one-line
error with its file:line (and ``on_bad_record = "skip"``), the KL samples (a seeded cycle, the
prompt with another record's completion, cut to the row), the labels through collation, the
spec's fields, the reference fingerprint and the paper's weighting check."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from pgs.errors import DataError, SpecError
from pgs.runtime.data import DataConfig
from pgs.runtime.data.kto import label_counts, partners, read_kto_records
from pgs.runtime.data.preference import PreferenceStream, collate_pairs, encode_arm
from pgs.runtime.loop.kto import kto_values, ratio_warning
from pgs.runtime.model.loading import load_tokenizer
from pgs.runtime.spec.load import PreferenceSpec, load_spec
from pgs.runtime.store import reference as cache
from helpers import model_toml, write_toml

QUICKSTART_TOKENIZER = "pgs/assets/quickstart/tokenizer"
USER = {"role": "user", "content": "What is 2 + 2?"}


@functools.cache
def tok():
    return load_tokenizer(QUICKSTART_TOKENIZER, False)


def config(path, **kw) -> DataConfig:
    return DataConfig(sources=[str(path)], max_seq_len=kw.pop("max_seq_len", 256), **kw)


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def record(i: int, label: bool = True) -> dict:
    return {"prompt": f"What is {i} + {i}?", "completion": str(2 * i), "label": label}


def test_three_shapes_give_the_same_record(tmp_path):
    strings = {"prompt": USER["content"], "completion": "4", "label": True}
    messages = {"prompt": [USER], "completion": [{"role": "assistant", "content": "4"}], "label": True}
    whole = {"messages": [USER, {"role": "assistant", "content": "4"}], "label": True}
    path = write(tmp_path / "k.jsonl", [strings, messages, whole, record(7, False)])
    pairs = read_kto_records([path], tok(), config(path))
    assert [p.index for p in pairs] == [0, 1, 2, 3]
    assert [p.desirable for p in pairs] == [True, True, True, False]
    for pair in pairs[:3]:
        assert (pair.chosen.input_ids, pair.chosen.train_mask) == (pairs[0].chosen.input_ids,
                                                                    pairs[0].chosen.train_mask)
    trained = tok().decode([t for t, m in zip(pairs[0].chosen.input_ids, pairs[0].chosen.train_mask) if m])
    assert trained.startswith("4") and "2 + 2" not in trained  # the completion only, SFT's mask
    assert label_counts(pairs) == (3, 1)


def test_kl_sample_is_the_prompt_with_another_records_completion(tmp_path):
    rows = [record(i, i % 2 == 0) for i in range(1, 8)]
    path = write(tmp_path / "k.jsonl", rows)
    data = config(path, seed=5)
    pairs = read_kto_records([path], tok(), data)
    sigma = partners(len(rows), 5)
    assert sorted(sigma) == list(range(len(rows))) and all(s != i for i, s in enumerate(sigma))
    # one cycle through all records: every completion is some record's KL sample exactly once
    seen, i = set(), 0
    for _ in rows:
        seen.add(i)
        i = sigma[i]
    assert seen == set(range(len(rows)))
    for i, pair in enumerate(pairs):
        other = rows[sigma[i]]
        ids, mask = encode_arm(tok(), [{"role": "user", "content": rows[i]["prompt"]}],
                               [{"role": "assistant", "content": other["completion"]}], None, data)
        assert (list(pair.rejected.input_ids), list(pair.rejected.train_mask)) == (ids, mask)
    assert partners(len(rows), 5) == sigma and partners(len(rows), 6) != sigma  # seeded


def test_kl_sample_is_cut_to_the_room_left_in_the_row(tmp_path):
    long = {"prompt": "hi", "completion": " ".join(["word"] * 12), "label": False}
    path = write(tmp_path / "k.jsonl", [record(1), long])
    roomy = read_kto_records([path], tok(), config(path, max_seq_len=400))
    full = len(roomy[0].rejected)  # record 0's KL sample: its prompt with the long completion
    own = roomy[1].chosen
    tight = len(own) + own.train_mask.index(True) + 1  # the least the long record itself needs
    pairs = read_kto_records([path], tok(), config(path, max_seq_len=tight))
    assert len(pairs[0].chosen) + len(pairs[0].rejected) == tight and len(pairs[0].rejected) < full
    assert pairs[0].rejected.input_ids == roomy[0].rejected.input_ids[:len(pairs[0].rejected)]
    assert pairs[0].rejected.num_trained > 0


@pytest.mark.parametrize("line,message", [
    ({"prompt": "a", "completion": "b"}, "missing 'label' (true for a desirable completion"),
    ({"prompt": "a", "completion": "b", "label": 1}, "'label' must be true or false, got 1"),
    ({"prompt": "a", "completion": "b", "label": "yes"}, "'label' must be true or false, got \"yes\""),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "label": True}, "a preference pair ('chosen'/'rejected')"),
    ({"prompt": "a", "label": True}, "missing 'completion'"),
    ({"completion": "a", "label": True}, "missing 'prompt'"),
    ({"prompt": "a", "completion": "", "label": True}, "the completion is empty"),
    ({"prompt": "a", "completion": [{"role": "user", "content": "x"}], "label": True},
     "'completion' must start with an assistant message"),
    ({"messages": [USER], "label": True}, "'messages' does not end with an assistant message"),
    ({"messages": [{"role": "assistant", "content": "4"}], "label": True}, "'messages' has no prompt"),
    ({"messages": [USER, {"role": "assistant", "content": "4"}], "prompt": "a", "label": True},
     "either 'messages' or 'prompt' and 'completion'"),
    ("{not json", "malformed JSON"),
])
def test_bad_record_is_one_line_with_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "k.jsonl", [record(1), record(2, False), line])
    with pytest.raises(DataError) as err:
        read_kto_records([path], tok(), config(path))
    text = str(err.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text
    stats_skipped: list[str] = []
    kept = read_kto_records([path], tok(), config(path, on_bad_record="skip"), skipped=stats_skipped)
    assert len(kept) == 2 and len(stats_skipped) == 1 and stats_skipped[0] == text


def test_too_long_record_and_too_few_records(tmp_path):
    long = {"prompt": "hi", "completion": " ".join(["word"] * 15), "label": True}
    path = write(tmp_path / "k.jsonl", [record(1), record(2), long])
    with pytest.raises(DataError, match=r":3: the record is \d+ tokens; with its KL sample .* > data.max_seq_len = 64"):
        read_kto_records([path], tok(), config(path, max_seq_len=64))
    one = write(tmp_path / "one.jsonl", [record(1)])
    with pytest.raises(DataError, match=r"1 usable KTO record\(s\); kind = \"kto\" needs at least 2"):
        read_kto_records([one], tok(), config(one))


def test_stream_batches_carry_the_labels_and_resume(tmp_path):
    path = write(tmp_path / "k.jsonl", [record(i, i % 3 == 0) for i in range(1, 30)])
    data = config(path, max_seq_len=96)
    stream = PreferenceStream(data, tok(), read=read_kto_records)
    assert stream.stats.records == 29 and stream.stats.bad_records == 0
    batch = stream.next_batch(2)
    assert batch.desirable is not None and batch.desirable.dtype == torch.bool
    assert batch.desirable.tolist() == [stream.pairs[int(i)].desirable for i in batch.pair_ids]
    state = stream.state_dict()
    after = stream.next_batch(2)
    again = PreferenceStream(data, tok(), read=read_kto_records)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch(2).input_ids, after.input_ids)
    # a relabelled record is other data: the resume is refused
    flipped = [record(i, i % 3 != 0) for i in range(1, 30)]
    other = PreferenceStream(config(write(tmp_path / "k.jsonl", flipped), max_seq_len=96), tok(),
                             read=read_kto_records)
    with pytest.raises(DataError, match="digest"):
        other.load_state_dict(state)
    paired = collate_pairs([[p] for p in stream.pairs[:2]], 0)
    assert paired.desirable.tolist() == [p.desirable for p in stream.pairs[:2]]


SPEC = model_toml(init_seed=None, num_hidden_layers=1, max_position_embeddings=256,
                  tie_word_embeddings=None) + """[data]
sources = ["pgs:quickstart/kto_train.jsonl"]
eval = "pgs:quickstart/kto_eval.jsonl"
max_seq_len = 256
[train]
steps = 2
batch_size = 2
[checkpoint]
dir = "{run_dir}"
{checkpoint}
[preference]
{preference}
"""


def spec_file(tmp_path: Path, preference: str, checkpoint: str = "") -> Path:
    return write_toml(tmp_path / "spec.toml", SPEC, preference=preference, checkpoint=checkpoint,
                      run_dir=tmp_path / "run")


def test_spec_fields(tmp_path):
    spec = load_spec(spec_file(tmp_path, 'kind = "kto"\nbeta = 0.2\ndesirable_weight = 1.2\nundesirable_weight = 0.9'))
    p = spec.preference
    assert (p.kind, p.beta, p.desirable_weight, p.undesirable_weight, p.uses_reference) == ("kto", 0.2, 1.2, 0.9, True)
    assert spec.checkpoint.best_metric == "eval_preference_accuracy"
    for text, match in (('kind = "dpo"\ndesirable_weight = 2.0', "preference.desirable_weight: 2.0 has no effect with kind = 'dpo'"),
                        ('kind = "kto"\nnll_weight = 0.1', "preference.nll_weight: 0.1 has no effect with kind = 'kto'"),
                        ('kind = "kto"\nundesirable_weight = 0', "preference.undesirable_weight"),
                        ('kind = "kto"\nlam = 1.0', "preference.lam"),
                        ('kind = "kt"', r"did you mean kto\?")):
        with pytest.raises(SpecError, match=match):
            load_spec(spec_file(tmp_path, text))
    assert PreferenceSpec().desirable_weight == 1.0


def test_validate_reads_kto_data_and_checks_the_best_metric(tmp_path):
    from pgs.runtime.spec.preflight import check_resources

    facts = check_resources(load_spec(spec_file(tmp_path, 'kind = "kto"')), records=40)
    assert facts["pairs"].startswith("40 records checked") and "desirable" in facts["pairs"]
    assert facts["eval"] == "40 held-out records checked"
    from pgs.runtime.spec.preflight import check_preference

    with pytest.raises(SpecError, match="'eval_logp_chosen' is not reported by a kto run"):
        check_preference(load_spec(spec_file(tmp_path, 'kind = "kto"', 'best_metric = "eval_logp_chosen"')), tok())
    check_preference(load_spec(spec_file(tmp_path, 'kind = "kto"', 'best_metric = "eval_kl"')), tok())


def test_reference_fingerprint_tells_kto_from_paired_caches(tmp_path):
    kto = load_spec(spec_file(tmp_path, 'kind = "kto"'))
    dpo = load_spec(spec_file(tmp_path, 'kind = "dpo"'))
    a, b = cache.fingerprint(kto, tok()), cache.fingerprint(dpo, tok())
    assert a["kto"] == f"KL samples seed {kto.data.seed}" and "kto" not in b
    path = str(tmp_path / "reference" / cache.CACHE_FILE)
    cache.save(path, {"train": torch.zeros(2, 2), "eval": torch.zeros(1, 2)}, a)
    with pytest.raises(cache.StaleReference, match="another kto than this run's"):
        cache.load(path, b)  # a KTO cache is not a paired run's
    assert cache.load(path, a)["train"].shape == (2, 2)


def test_the_papers_weight_ratio_check():
    p = PreferenceSpec(kind="kto")
    assert ratio_warning(p, 500, 500) is None and ratio_warning(p, 520, 400) is None  # 1.3 in [1, 4/3]
    text = ratio_warning(p, 300, 700)
    assert "= 0.429, outside the [1, 4/3] the KTO paper recommends" in text and "undesirable_weight = 0.367" in text
    assert ratio_warning(PreferenceSpec(kind="kto", undesirable_weight=0.367), 300, 700) is None  # 1.17
    assert "only one side of the loss trains" in ratio_warning(p, 10, 0)


def test_step_values_per_label():
    # sums: reward_d, reward_u, n_d, n_u, accuracy, logp_d, logp_u, z·n
    v = kto_values([3.0, -2.0, 3.0, 1.0, 3.5, -30.0, -12.0, 0.8], 4)
    assert v["reward_desirable"] == 1.0 and v["reward_undesirable"] == -2.0 and v["reward_margin"] == 3.0
    assert v["preference_accuracy"] == 0.875 and v["kl"] == 0.2 and v["logp_desirable"] == -10.0
    assert (v["desirable"], v["undesirable"], v["records"]) == (3, 1, 4)
    one_sided = kto_values([3.0, 0.0, 3.0, 0.0, 3.0, -30.0, 0.0, 0.0], 3)
    assert "reward_undesirable" not in one_sided and "reward_margin" not in one_sided


def test_best_metric_direction_of_preference_metrics():
    from pgs.runtime.loop.checkpointer import _improves

    assert _improves("eval_reward_margin", 0.3, 0.2) and not _improves("eval_reward_margin", 0.1, 0.2)
    assert _improves("eval_logp_chosen", -5.0, -6.0) and _improves("eval_preference_accuracy", 0.9, 0.8)
    assert _improves("eval_preference_loss", 0.4, 0.5) and not _improves("eval_kl", 0.5, 0.4)
    assert _improves("eval_loss", 1.0, 2.0)


def test_kind_kto_selects_the_kto_objective():
    import types

    from pgs.runtime.loop import objective as O
    from pgs.runtime.loop.kto import KTOObjective
    from pgs.runtime.loop.preference import PreferenceObjective

    assert O.objective_class(types.SimpleNamespace(preference=PreferenceSpec(kind="kto"))) is KTOObjective
    assert O.objective_class(types.SimpleNamespace(preference=PreferenceSpec(kind="dpo"))) is PreferenceObjective
    members = set(O.Objective.__annotations__) | {k for k, v in vars(O.Objective).items()
                                                  if callable(v) and not k.startswith("_")}
    assert [m for m in members if m != "stream" and not hasattr(KTOObjective, m)] == []
    assert KTOObjective.section == "preference" and not KTOObjective.splits_rows


def test_data_inspect_shows_labels_and_kl_samples(tmp_path):
    import io

    from rich.console import Console

    from pgs.runtime.data.inspect import inspect_pairs

    path = write(tmp_path / "k.jsonl", [record(1), record(2, False), record(3, False)])
    out = io.StringIO()
    stats = inspect_pairs(config(path), tok(), n=2, console=Console(file=out, width=200), kto=True)
    text = out.getvalue()
    assert f"{path}:1 desirable" in text and f"{path}:2 undesirable" in text and "KL sample" in text
    assert "KTO data statistics" in text and "1 / 2" in text and stats.records == 3
