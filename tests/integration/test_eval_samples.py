"""``[eval] samples = N``: greedy replies to the first N held-out prompts at every evaluation,
in ``<run dir>/samples/step_<N>.jsonl``, through the run's own generation path; the last
step's replies are what the exported model writes, greedily, through transformers' own
``generate``; ``pgs report`` shows them."""

from __future__ import annotations

import json

import torch
from helpers import QUICKSTART, quickstart_head, run_here, tiny_spec
from transformers import AutoModelForCausalLM, AutoTokenizer

from pgs.cli import main


def _first_prompt(record: dict) -> list[dict]:
    messages = record["messages"]
    return messages[:next(i for i, m in enumerate(messages) if m["role"] == "assistant")]


def test_samples_at_every_eval_are_the_models_greedy_replies(tmp_path, capsys):
    held_out = quickstart_head("eval.jsonl", 6, tmp_path / "held_out.jsonl")
    spec = tiny_spec(tmp_path, steps=4, eval_every=2, export="true")
    capsys.readouterr()
    assert run_here(spec, "--set", f'data.eval="{held_out.as_posix()}"', "--set", "eval.samples=3",
                    "--set", "eval.max_new_tokens=8") == 0  # in this process, one thread
    err = capsys.readouterr().err
    run_dir = tmp_path / "run"
    folder = run_dir / "samples"
    assert sorted(p.name for p in folder.iterdir()) == ["step_0.jsonl", "step_2.jsonl", "step_4.jsonl"]
    assert "samples  3 replies in samples/step_4.jsonl" in err
    records = [json.loads(line) for line in (QUICKSTART / "eval.jsonl").read_text().splitlines()[:3]]
    last = [json.loads(line) for line in (folder / "step_4.jsonl").read_text().splitlines()]
    assert [s["index"] for s in last] == [0, 1, 2] and all(s["step"] == 4 for s in last)
    assert [s["prompt"] for s in last] == [_first_prompt(r) for r in records]
    assert all(0 < s["new_tokens"] <= 8 for s in last)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_samples"] for r in evals if "eval_loss" in r] == [3, 3, 3]

    # the exported model (the weights after step 4) replies the same through HF's greedy generate
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    for sample in last:
        ids = tok.apply_chat_template(sample["prompt"], tools=sample.get("tools"), add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        assert len(new) == sample["new_tokens"]
        assert tok.decode(new, skip_special_tokens=True).strip() == sample["reply"]

    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "samples at step 4" in shown and last[0]["reply"][:20] in shown
