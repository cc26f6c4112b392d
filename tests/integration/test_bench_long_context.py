"""bench/long_context.py's harness, without a GPU: the generated records fill a row of the asked
length (one causal document per row, no padding document), a child's outcome is classified
(out of memory is a result, not a crash; pgs's preflight refusal; a timeout keeps what was
printed), a child is stopped early when its work is logged, and after a length that does not
fit the longer ones of that setup are skipped while the budget skips what it cannot start."""

import json
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import long_context as lc  # noqa: E402


def test_records_fill_the_row(tmp_path):
    from pgs.runtime.model.loading import load_tokenizer

    tokenizer = load_tokenizer(os.path.join(ROOT, "pgs", "assets", "quickstart", "tokenizer"))
    path = tmp_path / "long.jsonl"
    length = 4096
    lc.write_long_records(str(path), words=int(length * 1.25), records=2)
    for line in path.read_text().splitlines():
        completion = json.loads(line)["completion"]
        assert len(tokenizer(completion, add_special_tokens=False)["input_ids"]) > length


@pytest.mark.parametrize("rc, output, timed_out, status", [
    (0, "", False, "ok"),
    (1, "Traceback\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 74.00 GiB.", False, "oom"),
    (83, "pgs: error: data.max_seq_len = 131072: 1 rows × 131072 tokens need at least 150 GiB", False, "refused"),
    (1, "Traceback\nRuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", False, "error"),
    (None, "step 1", True, "timeout"),
])
def test_outcome(rc, output, timed_out, status):
    got, note = lc.outcome(rc, output, timed_out, 60)
    assert got == status
    if status == "oom":
        assert note.startswith("does not fit: ") and "Tried to allocate 74.00 GiB" in note
    if status == "error":
        assert "CUDNN_STATUS_NOT_SUPPORTED" in note and note.startswith("exit 1")


def test_run_child_timeout_keeps_output_and_kills_the_group():
    code = "import subprocess, sys, time; print('first', flush=True); " \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    t0 = time.time()
    rc, output, timed_out = lc.run_child([sys.executable, "-c", code], 3, dict(os.environ))
    assert timed_out and "first" in output and time.time() - t0 < 20


def test_run_child_done_ends_early_as_success(tmp_path):
    flag = tmp_path / "flag"
    code = f"import time, pathlib; pathlib.Path({str(flag)!r}).write_text('x'); time.sleep(60)"
    t0 = time.time()
    rc, _, timed_out = lc.run_child([sys.executable, "-c", code], 50, dict(os.environ), done=flag.exists)
    assert (rc, timed_out) == (0, False) and time.time() - t0 < 20


def test_longer_rows_skipped_after_oom_and_budget(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_pgs(shape, length, data, args, workdir, timeout, seco=0):
        calls.append(("pgs", length, timeout))
        status = "oom" if length >= 2048 else "ok"
        return {"setup": "pgs run", "shape": shape, "length": length, "status": status, "tok_s": 1.0,
                "error": "does not fit: CUDA out of memory" if status == "oom" else None}

    def fake_peer(variant, shape, length, args, timeout):
        calls.append((variant, length, timeout))
        return {"setup": variant, "shape": shape, "length": length, "status": "ok", "tok_s": 2.0}

    monkeypatch.setattr(lc, "run_pgs", fake_pgs)
    monkeypatch.setattr(lc, "run_peer", fake_peer)
    out = tmp_path / "out.json"
    lc.main(["--shapes", "qwen3-0.6b", "--lengths", "4096,1024,2048", "--steps", "1", "--timeout", "77",
             "--workdir", str(tmp_path), "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["setup"], r["length"], r["status"]) for r in results] == [
        ("pgs run", 1024, "ok"), ("hf_liger_ac", 1024, "ok"), ("pgs run", 2048, "oom"), ("hf_liger_ac", 2048, "ok"),
        ("pgs run", 4096, "skipped"), ("hf_liger_ac", 4096, "ok")]
    assert all(t == 77 for *_, t in calls)
    assert "does not fit at 2,048" in results[4]["error"]
    table = capsys.readouterr().out
    assert "| oom: does not fit: CUDA out of memory |" in table

    calls.clear()
    lc.main(["--shapes", "qwen3-0.6b", "--lengths", "1024", "--steps", "1", "--budget", "20",
             "--workdir", str(tmp_path), "--out", str(out)])
    assert calls == [] and all(r["status"] == "skipped" for r in json.loads(out.read_text())["results"])


@pytest.mark.parametrize("shape", sorted(lc.SPECS))
@pytest.mark.parametrize("steps", [1, 4])
def test_gpu_entries_pass_pgs_spec_checks(tmp_path, shape, steps):
    """The spec each GPU entry runs (shipped spec + long-row recipe at 128k tokens, few steps)
    loads, builds its chain and schedule for the run's steps, and its positions cover the row:
    what `pgs run` checks before it builds a model (the shipped specs' 10 warm-up steps in a
    4-step run were refused)."""
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.spec.preflight import check_chain, check_seq_len, model_config

    length = 131072
    data = tmp_path / "long.jsonl"
    lc.write_long_records(str(data), words=64, records=1)
    sets = lc.pgs_overrides(length, str(data), steps, 4096, str(tmp_path / "run"))
    spec = load_spec(os.path.join(ROOT, lc.SPECS[shape]), sets)
    assert (spec.data.max_seq_len, spec.data.packing, spec.memory.mlp_tiles) == (length, False, 16)
    assert spec.memory.offload_checkpoints and spec.memory.activation_checkpointing == "full"
    spec.build_chain(total_steps=spec.train.steps)  # the schedule fits the run
    check_chain(spec)
    check_seq_len(spec, model_config(spec.model, 485))


@pytest.mark.parametrize("shape", sorted(lc.SPECS))
def test_hf_peer_has_the_spec_model(shape):
    """Both sides train the same architecture: the HF peer's config table is the shipped spec's
    ``model.config`` (the bench raises ``max_position_embeddings`` on both alike)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import sft_step
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(os.path.join(ROOT, lc.SPECS[shape]))
    assert dict(spec.model.config) == sft_step.SHAPES[shape][0]


def test_terminated_bench_kills_its_running_child(tmp_path):
    """An outer timeout (SIGTERM to the bench) ends the child's own process group too."""
    import signal
    import subprocess

    pidfile = tmp_path / "pid"
    child_code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    script = tmp_path / "bench_like.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from bench import long_context as lc\n"
        "signal.signal(signal.SIGTERM, lc._on_terminate)\n"
        f"lc.run_child([sys.executable, '-c', {child_code!r}], 60, dict(os.environ))\n")
    bench = subprocess.Popen([sys.executable, str(script)])
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    child = int(pidfile.read_text())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=20) == 128 + signal.SIGTERM
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child outlived the terminated bench")


def test_summary_and_note_of_a_pgs_run():
    """tok/s from the steps after the warm-up, the peak over every step, skipped steps flagged."""
    steps = [{"step": i, "loss": 2.0, "tokens": 100, "step_seconds": s, "mem_gib": m, "reserved_gib": m + 1,
              "skipped": k} for i, s, m, k in ((1, 9.0, 5.0, 0), (2, 1.0, 7.0, 1), (3, 3.0, 6.0, 0))]
    got = lc._summary([{"step": 0, "event": "start"}] + steps, skip=1)
    assert got["tok_s"] == 200 / 4.0 and got["median_step_s"] == 2.0 and got["max_allocated_gib"] == 7.0
    assert got["max_reserved_gib"] == 8.0 and got["steps"] == 3 and got["skipped_steps"] == 1
    assert got["step_s"] == [9.0, 1.0, 3.0]  # every step's time, so an outlier behind a mean shows
    row = dict(got, setup="pgs run", shape="qwen3-0.6b", length=100, status="ok")
    assert "1 steps skipped" in lc._note(row)
    assert lc._note(dict(row, skipped_steps=0)) == ""
    assert "rows of 90 tokens" in lc._note(dict(row, skipped_steps=0, tokens_per_row=90))


def test_child_env_keeps_the_extras_on_pythonpath(monkeypatch):
    """device.sh puts the carried wheels (Liger for the HF peer) on PYTHONPATH: a child keeps them."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", ROOT]))
    paths = lc.child_env()["PYTHONPATH"].split(os.pathsep)
    assert paths == [ROOT, "/tmp/site"]


def test_table_columns_and_the_note():
    rows = [{"setup": "pgs run", "shape": "qwen3-0.6b", "length": 131072, "status": "ok", "tok_s": 4321.5,
             "median_step_s": 30.333, "max_allocated_gib": 60.004, "max_reserved_gib": 70.5, "error": None},
            {"setup": "hf_liger_ac", "shape": "qwen3-0.6b", "length": 131072, "status": "oom",
             "error": "does not fit: CUDA out of memory", "max_allocated_gib": 130.0}]
    assert lc.table(rows).splitlines() == [
        "| shape | tokens/row | setup | tok/s | median step s | peak alloc GiB | peak reserved GiB | note |",
        "|---|---|---|---|---|---|---|---|",
        "| qwen3-0.6b | 131,072 | pgs run | 4,322 | 30.33 | 60.00 | 70.50 |  |",
        "| qwen3-0.6b | 131,072 | hf_liger_ac |  |  | 130.00 |  | oom: does not fit: CUDA out of memory |"]


def test_records_are_sized_for_the_row_being_run(tmp_path):
    """words_for: records a little over the row's length with the spec's tokenizer (not the
    longest row's size for every row: a 128k-token record was tokenized whole for a 16k row)."""
    from pgs.runtime.model.loading import load_tokenizer

    path = os.path.join(ROOT, "pgs", "assets", "quickstart", "tokenizer")
    tokenizer = load_tokenizer(path)
    for length in (1024, 4096):
        data = tmp_path / f"long_{length}.jsonl"
        lc.write_long_records(str(data), words=lc.words_for(length, path), records=2)
        for line in data.read_text().splitlines():
            n = len(tokenizer(json.loads(line)["completion"], add_special_tokens=False)["input_ids"])
            assert length < n < 1.25 * length


def test_a_timeout_note_ends_with_what_the_run_printed_last():
    status, note = lc.outcome(None, "pgs: building the model\ndata: window 0\n", True, 150)
    assert status == "timeout" and note == "timeout after 150 s: pgs: building the model | data: window 0"


def test_seco_entry_and_the_longest_row_in_the_cap():
    assert lc.seco_overrides(4096) == ["memory.seco_chunk=4096", "memory.tied_slabs=0", "memory.compile_layers=false"]
    results = [{"setup": "pgs run", "shape": "qwen3-4b", "length": 32768, "status": "ok"},
               {"setup": "pgs run seco", "shape": "qwen3-4b", "length": 32768, "status": "ok"},
               {"setup": "pgs run", "shape": "qwen3-4b", "length": 65536, "status": "ok"},
               {"setup": "pgs run seco", "shape": "qwen3-4b", "length": 65536, "status": "oom"},
               {"setup": "pgs run", "shape": "qwen3-0.6b", "length": 16384, "status": "refused"}]
    line = lc.longest_line(results, 40)
    assert line == ("longest row trained in 40 GiB: pgs run qwen3-4b: 65,536; pgs run seco qwen3-4b: 32,768; "
                    "pgs run qwen3-0.6b: none")
