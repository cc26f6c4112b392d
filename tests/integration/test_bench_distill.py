"""bench/distill.py's own arithmetic and data, without running either system: the chats have
prompts of exactly the asked length (one row width per step) and fit the row; the figures are
the docstring's ratios; pgs's metrics records map onto them; the Markdown table shows errors."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import distill  # noqa: E402
from bench.product import markdown_table  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from pgs.runtime.model.loading import load_tokenizer

    return load_tokenizer(os.path.join(ROOT, "pgs", "assets", "quickstart", "tokenizer"))


def test_chats_have_prompts_of_the_asked_length(tmp_path, tokenizer):
    path = tmp_path / "chats.jsonl"
    lengths = distill.make_chats(str(path), 6, tokenizer, 120, 40, seed=3)
    assert lengths == [120] * 6
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6 and len({r["messages"][0]["content"] for r in records}) == 6
    for r in records:
        user, assistant = r["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == 120  # what both systems prompt with
        assert len(tokenizer(assistant["content"], add_special_tokens=False)["input_ids"]) >= 40


def test_figures_are_the_documented_ratios():
    steps = [{"step_s": 9.0, "gen_s": 8.0, "generated": 1, "trained": 1, "loss_tokens": 1},  # warm-up: left out
             {"step_s": 2.0, "gen_s": 1.5, "generated": 100, "trained": 300, "loss_tokens": 100},
             {"step_s": 4.0, "gen_s": 2.5, "generated": 200, "trained": 600, "loss_tokens": 200}]
    f = distill.figures(steps, 1, prompts=4)
    assert f["steps"] == 3 and f["timed_steps"] == 2 and f["first_steps_s"] == [9.0]
    assert f["gen_tok_s"] == pytest.approx(300 / 4.0)
    assert f["train_tok_s"] == pytest.approx(900 / 2.0)
    assert f["e2e_tok_s"] == pytest.approx(1200 / 6.0)
    assert f["prompts_per_s"] == pytest.approx(8 / 6.0)
    assert f["gen_share"] == pytest.approx(4.0 / 6.0)
    assert f["generated_per_step"] == 150 and f["trained_per_step"] == 450 and f["loss_tokens_per_step"] == 150
    assert "error" in distill.figures(steps[:1], 1, prompts=4)


def test_pgs_records_map_generation_time_from_the_rate():
    records = [{"step": 1, "loss": 0.5, "tokens": 800, "valid_tokens": 250, "step_seconds": 2.0,
                "generated_tokens": 256, "gen_tokens_per_s": 128.0},
               {"step": 1, "eval_loss": 1.0},  # not a step record
               {"step": 2, "loss": 0.4, "tokens": 700, "valid_tokens": 200, "step_seconds": 1.0,
                "generated_tokens": 0, "gen_tokens_per_s": 0.0}]  # an off-policy step: no generation
    assert distill.pgs_steps(records) == [
        {"step_s": 2.0, "gen_s": 2.0, "generated": 256, "trained": 800, "loss_tokens": 250},
        {"step_s": 1.0, "gen_s": 0.0, "generated": 0, "trained": 700, "loss_tokens": 200}]


def test_table_shows_an_error_row_by_its_last_line():
    rows = [{"setup": "pgs", "e2e_tok_s": 1234.5, "gen_tok_s": None},
            {"setup": "trl", "error": "Traceback ...\nValueError: boom"}]
    text = markdown_table(rows, [("e2e", "e2e_tok_s", ",.0f"), ("gen", "gen_tok_s", ",.0f")])
    lines = text.splitlines()
    assert lines[0] == "| setup | e2e | gen |" and lines[1] == "|---|---|---|"
    assert lines[2] == "| pgs | 1,234 |  |"
    assert lines[3].startswith("| trl | error: ValueError: boom") and lines[3].count("|") == lines[0].count("|")


def test_profile_steps_refused_past_the_run(capsys):
    for bad, why in (("5:9", "past --steps 8"), ("3", "is not A:B")):
        with pytest.raises(SystemExit) as exit_:
            distill.main(["--profile", bad, "--steps", "8", "--only", "pgs"])
        assert exit_.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.slow
def test_small_pgs_run_with_a_profile(tmp_path):
    """The pgs setup end to end at the smoke shape (the product path: ``pgs run`` with [distill]),
    its figures from its own metrics, and ``--profile``'s operator table beside the JSON."""
    out = tmp_path / "d.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "bench", "distill", "--small", "--only", "pgs", "--profile", "2:3",
                           "--workdir", str(tmp_path), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    [r] = json.loads(out.read_text())["results"]
    assert not r.get("error") and r["timed_steps"] == 2 and r["e2e_tok_s"] > 0
    assert r["generated_per_step"] > 0 and r["trained_per_step"] > r["generated_per_step"]
    assert "--profile 2:3" in r["command"]
    ops = tmp_path / "d-ops.txt"
    assert r["profile"] == [str(ops)] and "aten::" in ops.read_text()


def test_trl_setups_take_their_own_prompt_count(monkeypatch, capsys):
    """``--trl-prompts N``: the TRL child is asked for N prompts per step and its row says so
    (TRL at the pgs batch does not fit an H200); negative counts are refused."""
    import argparse

    seen = []
    monkeypatch.setattr(distill, "_run_trl", lambda args, variant, chats, timeout, prompts: (
        seen.append(prompts) or {"setup": f"TRL GKDTrainer ({variant})", "e2e_tok_s": 1.0}))
    args = argparse.Namespace(prompts=16, trl_prompts=4)
    assert distill.run_trl(args, "trl", "chats.jsonl", 10.0) == {"setup": "TRL GKDTrainer (trl)", "prompts": 4,
                                                                 "e2e_tok_s": 1.0}
    args.trl_prompts = 0
    assert distill.run_trl(args, "trl", "chats.jsonl", 10.0)["prompts"] == 16 and seen == [4, 16]
    with pytest.raises(SystemExit) as exit_:
        distill.main(["--trl-prompts", "-1", "--only", "pgs"])
    assert exit_.value.code == 2 and "--trl-prompts" in capsys.readouterr().err
