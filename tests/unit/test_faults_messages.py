"""Issue 29, items 4b, 4c, 5, 6 and 7: what was silently accepted or said badly, one test each.

CLI paths run in-process (``pgs.cli.main``) and assert the exit code and the one line; library
errors assert the exact message.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pgs.cli import main
from pgs.errors import DataError, InvalidArgument
from helpers import error_line, write_toml
from test_cli_malformed import DATA_SPEC

# the malformed-data fixtures' tiny spec, with a run folder of its own and room for more sections
SPEC = DATA_SPEC.replace("{path}", "{data}") + '[checkpoint]\ndir = "run"\n{extra}\n'


def _spec(tmp_path: Path, extra: str = "", data: str = "pgs:quickstart/train.jsonl") -> Path:
    return write_toml(tmp_path / "spec.toml", SPEC, extra=extra, data=data)


def _cli(args: list[str], capsys) -> subprocess.CompletedProcess:
    code = main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pgs", *args], code, out, err)


def _one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    line = error_line(proc.stderr)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    return line


# ------------------------------------------------------------------------- 5. messages


def test_string_learning_rate_names_the_alias_argument():
    import pgs.func as pf

    with pytest.raises(InvalidArgument) as err:
        pf.adamw("1e-3")
    assert str(err.value) == ("adamw: learning_rate must be a number, got the string '1e-3' "
                              "(write the number without quotes)")
    for alias in (pf.lion, pf.sgd, pf.sage, pf.adamc, pf.adamh, pf.muon, pf.muonh, pf.adamw8bit, pf.lion8bit):
        with pytest.raises(InvalidArgument, match=f"^{alias.__name__}: learning_rate must be a number"):
            alias("1e-3")


def test_betas_in_optimizer_args_says_b1_and_b2(tmp_path, capsys):
    spec = _spec(tmp_path, '[optimizer]\nalias = "adamw"\nargs = { betas = [0.9, 0.95] }')
    line = _one_line(_cli(["validate", str(spec)], capsys))
    assert line == ("pgs: error: optimizer.args.betas: unknown argument of adamw "
                    "(pgs uses b1 and b2 (betas=(b1, b2)): write b1 = 0.9, b2 = 0.95)")


def test_malformed_json_line_gives_the_whole_reason_with_its_column(tmp_path):
    from pgs.runtime.data.records import parse_line

    with pytest.raises(DataError) as err:
        parse_line('{"messages": "a\tb"}', "data.jsonl:3")
    assert str(err.value) == "data.jsonl:3: malformed JSON (Invalid control character '\\t' at column 16)"
    with pytest.raises(DataError) as err:
        parse_line('{"messages": [1, 2] x', "data.jsonl:4")
    assert str(err.value) == "data.jsonl:4: malformed JSON (Expecting ',' delimiter at column 21)"


# ------------------------------------------------------------------------- 4c. a chain without a learning rate


NO_LR = ("has no learning-rate stage: its updates would be added to the parameters as they are, "
         "climbing the loss; end it with ")


def test_bind_refuses_a_chain_without_a_learning_rate_stage():
    import torch

    import pgs.func as pf
    from pgs.runtime import bind
    from pgs.runtime.optim.release import GradientRelease

    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidArgument) as err:
        bind(pf.scale_by_adam(), model)
    assert str(err.value) == f"bind: the chain (scale_by_adam) {NO_LR}scale_by_learning_rate(lr) (or hyperball(lr))"
    with pytest.raises(InvalidArgument) as err:
        GradientRelease(pf.chain(pf.clip_by_norm_per_tensor(1.0), pf.scale_by_adam()), model)
    assert str(err.value) == ("GradientRelease: the chain (clip_by_norm_per_tensor, scale_by_adam) "
                              f"{NO_LR}scale_by_learning_rate(lr) (or hyperball(lr))")
    with pytest.raises(InvalidArgument, match="a partition branch \\(scale_by_lion\\) has no learning-rate stage"):
        bind(pf.partition({"a": pf.adamw(), "b": pf.scale_by_lion()}, lambda path, p: "b" if p.ndim == 1 else "a"),
             model)
    # a step stage anywhere, an explicit ascent, hyperball, or a transform of the user's own: accepted
    for chain in (pf.adamw(1e-3), pf.muon(), pf.chain(pf.scale_by_adam(), pf.hyperball(0.01)),
                  pf.chain(pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3, flip_sign=False)),
                  pf.inject_hyperparams(pf.adamw)(learning_rate=1e-3),
                  pf.chain(pf.scale_by_adam(), pf.Transform(lambda p, **e: (), lambda u, s, p=None, **e: (u, s)))):
        bind(chain, torch.nn.Linear(4, 4))


def test_spec_chain_without_a_learning_rate_stage_is_one_line(tmp_path, capsys):
    spec = _spec(tmp_path, '[optimizer]\nchain = [{ name = "scale_by_adam" }]')
    line = _one_line(_cli(["validate", str(spec)], capsys))
    assert line == (f'pgs: error: optimizer.chain: the chain (scale_by_adam) {NO_LR}'
                    '{ name = "scale_by_learning_rate" } (or hyperball(lr))')


# ------------------------------------------------------------------------- 4b. an empty assistant turn

QUICKSTART_TOKENIZER = "pgs/assets/quickstart/tokenizer"
EMPTY_TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
              {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]


def test_an_empty_assistant_turn_is_not_trained_and_is_counted(tmp_path, capsys):
    from transformers import AutoTokenizer

    from pgs.runtime.data import encode_chat
    from pgs.runtime.data.chat import empty_assistant_turns

    tok = AutoTokenizer.from_pretrained(QUICKSTART_TOKENIZER)
    ids, mask = encode_chat(tok, EMPTY_TURN)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "ok<|im_end|>"  # not the empty turn's end marker
    assert "<|im_start|>assistant\n<|im_end|>" in tok.decode(ids)  # still there as context
    assert empty_assistant_turns(EMPTY_TURN) == 1 and empty_assistant_turns(EMPTY_TURN, last_turn_only=True) == 0
    tool_call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                      "function": {"name": "f", "arguments": {}}}]}
    assert empty_assistant_turns([EMPTY_TURN[0], tool_call]) == 0

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": EMPTY_TURN}) for _ in range(3)) + "\n", encoding="utf-8")
    spec = _spec(tmp_path, data=data.as_posix())
    warning = ("warning: 3 empty assistant turns (no content, tool calls or reasoning) left untrained; "
               "fill or remove them in the data")
    proc = _cli(["data", "inspect", str(spec), "-n", "1"], capsys)
    assert proc.returncode == 0, proc.stderr
    assert "empty assistant turns (not trained)" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line.startswith("warning:")] == [warning]
    proc = _cli(["validate", str(spec)], capsys)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("warning:")] == [warning]


# ------------------------------------------------------------------------- 6. pgs profile


def test_profile_uses_the_tokenizer_vocabulary_and_labels_total_and_peak(tmp_path):
    from rich.console import Console

    from pgs.runtime.tools.profile import GiB, plan_from_spec, predict_memory, profile
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(_spec(tmp_path))
    plan = plan_from_spec(spec)
    assert plan["config"].vocab_size == 485  # len(tokenizer), as pgs run builds it (not qwen3's 151,936)
    weights = predict_memory(plan["config"], **plan["kwargs"])["weights"]
    assert weights < 0.01 * GiB
    console = Console(record=True, width=200)
    assert profile(spec, console=console) == 0
    text = console.export_text()
    assert "total (sum of the above, if all were live at once)" in text
    assert "peak (what is live together at the worst phase)" in text
    assert "vocabulary 485; the peak is the figure to compare with a GPU" in text
    assert "checkpoint snapshot" not in text


def test_profile_counts_the_background_saves_host_snapshot(tmp_path):
    from rich.console import Console

    from pgs.runtime.tools.profile import checkpoint_bytes, plan_from_spec, predict_memory, profile
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(_spec(tmp_path), overrides=["checkpoint.background=true"])
    plan = plan_from_spec(spec)
    pred = predict_memory(plan["config"], **plan["kwargs"])
    want = pred["weights"] + pred["master_weights"] + pred["optimizer_state"]
    assert checkpoint_bytes(pred) == want > 0
    console = Console(record=True, width=200)
    assert profile(spec, console=console) == 0
    row = next(line for line in console.export_text().splitlines() if "host: checkpoint snapshot" in line)
    assert float(row.split()[-2]) == pytest.approx(want / 2**20, abs=1e-3)  # the tiny model's figures are MiB


# ------------------------------------------------------------------------- 7. pgs data inspect to a file


def test_data_inspect_to_a_file_marks_the_trained_tokens(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                             {"role": "assistant", "content": "4"}]}) + "\n", encoding="utf-8")
    proc = _cli(["data", "inspect", str(_spec(tmp_path, data=data.as_posix())), "-n", "1"], capsys)
    assert proc.returncode == 0, proc.stderr
    assert "<|im_start|>assistant\n[[4<|im_end|>]]" in proc.stdout
    assert proc.stdout.count("[[") == 1 and "\x1b[" not in proc.stdout


def test_run_on_a_cuda_device_this_host_lacks_is_one_line(tmp_path, capsys):
    """A spec for ``cuda`` (the shipped GPU recipes) run where there is none, or for a CUDA index
    past the host's devices: one line naming train.device (was a traceback from torch.cuda)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if count == 0 else f"cuda:{count}"
    proc = _cli(["run", str(_spec(tmp_path)), "--set", f'train.device="{device}"', "--set", "train.steps=1"], capsys)
    line = _one_line(proc)
    assert line.startswith(f"pgs: error: train.device: '{device}', but this host has "), line
