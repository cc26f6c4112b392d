"""From the data a user has to a model that stops: Mistral-style tool-call conversations masked
by prefix diffing (``data.chat_template = "mistral-v3"``), trained through ``pgs run``, exported,
and greedy generation from the export ends its turn with the end-of-turn token.  And ``pgs data
inspect`` shows the trained tokens of the new sources and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pgs.cli import main
from pgs.runtime.data.synthetic import generate, write_jsonl
from helpers import LOOP, loop_fields, model_toml, run_here, write_toml

MISTRAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]"]

SPEC = """{model}
[data]
sources = [{sources}]
max_seq_len = 256
chat_template = "mistral-v3"
seed = 1
""" + LOOP


def mistral_tokenizer(folder: Path) -> str:
    """The quickstart tokenizer with Mistral's control tokens (<s>, </s>, [INST], [TOOL_CALLS]...)."""
    tok = AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": MISTRAL_TOKENS})
    tok.save_pretrained(folder)
    return str(folder)


def write_spec(tmp_path: Path, sources: str, steps: int = 10) -> Path:
    model = model_toml(mistral_tokenizer(tmp_path / "tok"), hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    fields = loop_fields(schedule='name = "cosine"\npeak = 1e-2\nwarmup = 5', grad_accum=1, export="true",
                         steps=steps, run_dir=tmp_path / "run")
    return write_toml(tmp_path / "spec.toml", SPEC, model=model, sources=sources, **fields)


@pytest.mark.slow
def test_mistral_tool_calls_train_export_and_stop_at_end_of_turn(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    data = tmp_path / "tools.jsonl"
    write_jsonl(str(data), generate(400, seed=11, weather_share=1.0))
    spec = write_spec(tmp_path, f'{{ path = "{data}" }}', steps=150)
    assert run_here(spec) == 0  # in this process, one thread
    final = tmp_path / "run" / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert "[TOOL_CALLS]" in tokenizer.chat_template  # the export carries the training template
    eos = tokenizer.convert_tokens_to_ids("</s>")
    assert model.generation_config.eos_token_id == eos
    conversation = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = generate(1, seed=0, weather_share=1.0)[0]["tools"]
    for turn in (conversation, conversation + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "23C, sunny"}]):
        prompt = tokenizer.apply_chat_template(turn, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=60,
                                 do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        assert eos in new, tokenizer.decode(new)
        assert new.index(eos) == len(new) - 1  # generation stopped at the end-of-turn token
        text = tokenizer.decode(new)
        if len(turn) == 1:
            assert text.startswith("[TOOL_CALLS] [{\"name\": \"get_weather\""), text
        else:
            assert text.endswith(".</s>") and "[TOOL_CALLS]" not in text, text


def test_data_inspect_shows_the_trained_tokens_of_every_source(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the sample headers (file:row) uncut
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = generate(3, seed=11, weather_share=1.0)
    parquet = tmp_path / "tools.parquet"
    for r in records:  # arguments as JSON strings, as tables usually hold them
        for m in r["messages"]:
            for c in m.get("tool_calls") or []:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    pq.write_table(pa.Table.from_pylist(records), parquet)
    array = tmp_path / "docs.json"
    array.write_text(json.dumps([{"text": "Plain prose, trained whole."}]))
    spec = write_spec(tmp_path, f'{{ path = "{parquet}" }}, {{ path = "{array}" }}')
    assert main(["data", "inspect", str(spec), "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{parquet}:row 0" in out and f"{array}:item 0" in out
    assert '[[[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ' in out
    assert "}}]</s>]][TOOL_RESULTS]" in out  # the tool result is context
    assert "[[Plain prose, trained whole.</s>]]" in out


def test_spec_chat_template_by_name_by_file_and_refused(tmp_path, capsys):
    from pgs.runtime.spec.load import load_spec

    data = tmp_path / "d.jsonl"
    write_jsonl(str(data), generate(8, seed=1, weather_share=0.5))
    spec = write_spec(tmp_path, f'{{ path = "{data}" }}')
    assert load_spec(spec).data.chat_template.endswith("templates/mistral-v3.jinja")
    (tmp_path / "mine.jinja").write_text((Path(__file__).resolve().parents[1] / "templates" / "mistral_v7.jinja").read_text())
    spec.write_text(spec.read_text().replace('chat_template = "mistral-v3"', 'chat_template = "mine.jinja"'))
    assert load_spec(spec).data.chat_template == str(tmp_path / "mine.jinja")
    assert main(["validate", str(spec)]) == 0
    spec.write_text(spec.read_text().replace('chat_template = "mine.jinja"', 'chat_template = "mistral"'))
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pgs: error: data.chat_template: 'mistral' is neither a file nor a template pgs ships "
                   "(chatml, glm4, mistral-v3, mistral-v7)"]
