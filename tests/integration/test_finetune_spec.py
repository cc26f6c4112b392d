"""The plain recipe, specs/finetune.toml, trains a user's model folder on the user's chats as
shipped, with only the model, the data and (no GPU here) the device changed: bf16 weights,
AdamW, cosine schedule, packing, activation checkpointing, eval, the exported folder."""

from __future__ import annotations

import json

import torch
from helpers import QUICKSTART, ROOT, quickstart_head, run_here
from tiny import from_config, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_finetune_spec_trains_a_model_folder(tmp_path):
    folder = tmp_path / "my_model"
    from_config(tiny_config("qwen3", vocab_size=512, max_position_embeddings=4096)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer").save_pretrained(folder)
    train = quickstart_head("train.jsonl", 48, tmp_path / "my_chats.jsonl")
    held_out = quickstart_head("eval.jsonl", 8, tmp_path / "held_out.jsonl")
    run_dir = tmp_path / "run"
    sets = [f"model.path={folder.as_posix()}", f'data.sources=["{train.as_posix()}"]',
            f'data.eval="{held_out.as_posix()}"', "data.max_seq_len=256", 'train.device="cpu"',
            f'checkpoint.dir="{run_dir.as_posix()}"', "schedule.warmup=1"]  # a run of a few steps
    assert run_here(ROOT / "specs" / "finetune.toml", *(a for s in sets for a in ("--set", s))) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r and "eval_loss" not in r]
    evals = [r for r in records if "eval_loss" in r]
    assert steps and evals, records
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    resolved = (run_dir / "spec.resolved.toml").read_text()
    assert 'dtype = "bfloat16"' in resolved and 'activation_checkpointing = "full"' in resolved
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.dtype == torch.bfloat16
    assert len(AutoTokenizer.from_pretrained(run_dir / "final")) == len(AutoTokenizer.from_pretrained(folder))
    trained = dict(model.named_parameters())
    start = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    assert any(not torch.equal(trained[k].float(), start[k].to(trained[k].dtype).float()) for k in start)
