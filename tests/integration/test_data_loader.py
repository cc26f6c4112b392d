"""StepLoader: the worker's steps (process or thread) equal the synchronous path's, resume is
exact with a worker that has read ahead, failures surface in next_step (never a hang), close
ends the worker.  Also the data pipeline's fast paths against their plain definitions."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pgs.errors import EXIT_BAD_INPUT, DataError
from pgs.runtime.data import DataConfig, DataSource, Document, TrainStream, collate, encode_chat
from pgs.runtime.data import chat
from pgs.runtime.data import loader as loader_module
from pgs.runtime.data.loader import DataWorkerFailed, StepLoader
from pgs.runtime.data.synthetic import generate, write_jsonl

TOKENIZER = "pgs/assets/quickstart/tokenizer"
POISONED_LINES = (12, 29)  # 1-based lines of bad.jsonl whose record the strict template refuses
WORKERS = ["process", "thread"]


class FlakyStream(TrainStream):
    """Raises at its ``fail_at``-th ``next_batch`` (module level: a worker process unpickles it)."""

    fail_at = 3
    calls = 0

    def next_batch(self, batch_size):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"tokenizer exploded at call {self.fail_at}")
        return super().next_batch(batch_size)


class DyingStream(TrainStream):
    """Its worker ends at once, saying nothing (a process exits 3, a thread returns)."""

    def next_batch(self, batch_size):
        if threading.current_thread() is threading.main_thread():
            os._exit(3)  # in a worker process
        raise SystemExit  # a thread's silent end (the worker forwards it; see the thread test)


class StuckStream(TrainStream):
    """Never makes a batch (a stalled worker)."""

    def next_batch(self, batch_size):
        time.sleep(3600)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def strict_tok():
    """The quickstart tokenizer with a template that refuses any message containing POISON."""
    strict = AutoTokenizer.from_pretrained(TOKENIZER)
    strict.chat_template = (
        "{%- for m in messages %}{%- if 'POISON' in m.content %}"
        "{{ raise_exception('poisoned record') }}{%- endif %}{%- endfor %}" + strict.chat_template
    )
    return strict


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loader")
    a, b, bad = str(folder / "a.jsonl"), str(folder / "b.jsonl"), str(folder / "bad.jsonl")
    write_jsonl(a, generate(60, seed=1, weather_share=0.0))
    write_jsonl(b, generate(30, seed=2, weather_share=1.0))
    rows = generate(40, seed=3, weather_share=0.5)
    for line in POISONED_LINES:
        rows[line - 1]["messages"][0]["content"] += " POISON"
    write_jsonl(bad, rows)
    return a, b, bad


def mixed(files, **kw):
    a, b, _ = files
    return DataConfig(sources=[DataSource(a, weight=3.0), DataSource(b, weight=1.0)], max_seq_len=160, **kw)


def make_loader(config, tokenizer, *, micro_batch=2, grad_accum=3, pack_window=16, kind=TrainStream, **kw):
    return StepLoader(kind(config, tokenizer, pack_window=pack_window), micro_batch, grad_accum,
                      torch.device("cpu"), **kw)


def assert_same_step(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name in ("input_ids", "labels", "position_ids"):
            x, y = getattr(g, name), getattr(w, name)
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), name
        assert len(g.cu_seqlens) == len(w.cu_seqlens)
        assert all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(g.cu_seqlens, w.cu_seqlens))
        assert (g.num_docs, g.num_trained_tokens, g.num_tokens) == (w.num_docs, w.num_trained_tokens, w.num_tokens)
        assert all(type(v) is int for v in (g.num_docs, g.num_trained_tokens, g.num_tokens))


def wait_until(predicate, what, limit=60.0):
    """Wait for a condition of the worker (a correctness precondition, not a timing)."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.01)


def read_ahead(loader, steps=2):
    """Wait until the worker has ``steps`` steps ready that were not handed out."""
    wait_until(lambda: loader._worker.queue.qsize() >= steps, "the worker reading ahead")


# -- order ---------------------------------------------------------------------------------
@pytest.mark.parametrize("worker", WORKERS)
def test_worker_steps_equal_the_synchronous_path_and_the_stream(files, tok, worker):
    steps = 24  # several windows of 16 documents
    plain = TrainStream(mixed(files), tok, pack_window=16)
    with make_loader(mixed(files), tok, threaded=False) as sync, make_loader(mixed(files), tok, worker=worker) as ahead:
        assert ahead.worker == worker
        for _ in range(steps):
            want = [plain.next_batch(2) for _ in range(3)]
            s, t = sync.next_step(), ahead.next_step()
            assert_same_step(s, want)
            assert_same_step(t, want)
            assert sync.state_dict() == ahead.state_dict() == plain.state_dict()
            assert ahead.stats.as_dict() == plain.stats.as_dict()


@pytest.mark.parametrize("worker", WORKERS)
def test_cpu_batches_are_not_pinned_or_copied(files, tok, worker):
    with make_loader(mixed(files), tok, worker=worker) as loader:
        for batch in loader.next_step():
            assert batch.input_ids.device.type == "cpu" and not batch.input_ids.is_pinned()


@pytest.mark.parametrize("worker", WORKERS)
def test_state_dict_is_the_consumed_position_not_the_read_ahead(files, tok, worker):
    plain = TrainStream(mixed(files), tok, pack_window=16)
    with make_loader(mixed(files), tok, ahead=3, worker=worker) as loader:
        # a fresh stream's position: the thread worker may already be reading the live stream
        start = plain.state_dict()
        assert loader.state_dict() == start  # before any step
        if worker != "thread":  # the process reads its own copy: the live stream has not moved
            assert loader.stream.state_dict() == start
        for _ in range(5):
            loader.next_step()
            [plain.next_batch(2) for _ in range(3)]
        read_ahead(loader, 3)
        state = loader.state_dict()
        assert state == plain.state_dict()
        if worker == "thread":  # the worker's own stream is further on: its queued steps say where
            # (read under the queue's lock: the live stream is the worker thread's, mid-update)
            with loader._worker.queue.mutex:
                queued = [item[1] for item in loader._worker.queue.queue]
            assert len(queued) >= 3 and all(q != state for q in queued)
        else:
            assert loader.stream.state_dict() == start  # the process has a copy; this one stays
        json.dumps(state)


# -- resume --------------------------------------------------------------------------------
@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_resume_mid_window_is_exact_with_a_worker_that_read_ahead(files, tok, steps, worker):
    with make_loader(mixed(files), tok, ahead=2, worker=worker) as first:
        for _ in range(steps):
            first.next_step()
        read_ahead(first)
        state = json.loads(json.dumps(first.state_dict()))
        assert steps == 0 or 0 < state["taken"] < 8, "the position should be inside a window"  # 16 docs -> ~8 rows
        expected = [first.next_step() for _ in range(6)]
        # a fresh loader, as after a restart
        with make_loader(mixed(files), tok, worker=worker) as resumed:
            read_ahead(resumed)  # it read ahead from the start; load_state_dict drops that
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state
            for want in expected:
                assert_same_step(resumed.next_step(), want)
        # the same loader, back to the saved position while its worker is ahead
        read_ahead(first)
        first.load_state_dict(state)
        for want in expected:
            assert_same_step(first.next_step(), want)


def test_resume_matches_the_synchronous_path(files, tok):
    with make_loader(mixed(files), tok) as ahead:
        for _ in range(4):
            ahead.next_step()
        state = ahead.state_dict()
        want = [ahead.next_step() for _ in range(4)]
    with make_loader(mixed(files), tok, threaded=False) as sync:
        sync.load_state_dict(state)
        for w in want:
            assert_same_step(sync.next_step(), w)
        assert sync.stats.bad_records == 0


@pytest.mark.parametrize("worker", WORKERS)
def test_a_state_of_other_data_is_refused_by_load_state_dict(files, tok, worker):
    with make_loader(mixed(files), tok, worker=worker) as loader:
        state = loader.state_dict()
    with make_loader(mixed(files, seed=5), tok, worker=worker) as other:
        with pytest.raises(DataError, match="seed"):
            other.load_state_dict(state)
        with pytest.raises(DataError, match="seed"):
            other.next_step()


# -- failures ------------------------------------------------------------------------------
def first_error(loader, limit=200):
    for step in range(limit):
        try:
            loader.next_step()
        except Exception as err:  # noqa: BLE001
            return step, err
    raise AssertionError("no error within the limit")


@pytest.mark.parametrize("worker", WORKERS)
def test_bad_record_is_a_data_error_naming_file_and_line(files, strict_tok, worker):
    _, _, bad = files
    config = DataConfig(sources=[bad], max_seq_len=160)
    with make_loader(config, strict_tok, threaded=False) as sync, \
            make_loader(config, strict_tok, worker=worker) as ahead:
        want_step, want = first_error(sync)
        got_step, got = first_error(ahead)
        with pytest.raises(DataError) as again:  # raised again, not a hang
            ahead.next_step()
    assert isinstance(got, DataError) and type(got) is type(want)
    assert got.exit_code == EXIT_BAD_INPUT
    assert got_step == want_step and str(got) == str(want) == str(again.value)
    assert any(str(got).startswith(f"{bad}:{line}: ") for line in POISONED_LINES), str(got)
    assert "poisoned record" in str(got)


@pytest.mark.parametrize("worker", WORKERS)
def test_skipped_bad_records_give_the_synchronous_batches(files, strict_tok, worker):
    _, _, bad = files
    config = DataConfig(sources=[bad], max_seq_len=160, on_bad_record="skip")
    with make_loader(config, strict_tok, threaded=False) as sync, \
            make_loader(config, strict_tok, worker=worker) as ahead:
        for _ in range(20):
            assert_same_step(ahead.next_step(), sync.next_step())
            assert ahead.state_dict() == sync.state_dict()
        assert ahead.stats.bad_records > 0


@pytest.mark.parametrize("threaded,worker", [(True, "process"), (True, "thread"), (False, "process")])
def test_any_worker_exception_is_raised_with_its_type_in_next_step(files, tok, threaded, worker):
    reference = TrainStream(mixed(files), tok, pack_window=16).next_batch(2)
    with make_loader(mixed(files), tok, grad_accum=1, kind=FlakyStream, threaded=threaded, worker=worker) as loader:
        assert_same_step(loader.next_step(), [reference])
        loader.next_step()
        state = loader.state_dict()
        with pytest.raises(RuntimeError, match="tokenizer exploded at call 3"):
            loader.next_step()
        with pytest.raises(RuntimeError, match="tokenizer exploded at call 3"):
            loader.next_step()
        assert loader.state_dict() == state  # the failed step was not handed out


def test_a_worker_thread_that_ends_silently_is_an_error_not_a_hang(files, tok, monkeypatch):
    monkeypatch.setattr(loader_module, "_produce", lambda *args: None)
    with make_loader(mixed(files), tok, worker="thread") as loader:
        with pytest.raises(DataWorkerFailed, match="thread ended without a step") as err:
            loader.next_step()
        assert err.value.exit_code == 1


def test_a_worker_process_that_dies_is_an_error_not_a_hang(files, tok):
    with make_loader(mixed(files), tok, kind=DyingStream, worker="process") as loader:
        with pytest.raises(DataWorkerFailed, match=r"process ended \(exit code 3\) without a step") as err:
            loader.next_step()
        assert err.value.exit_code == 1


@pytest.mark.parametrize("worker", WORKERS)
def test_a_stalled_worker_is_an_error_not_a_hang(files, tok, worker, monkeypatch):
    if worker == "thread":  # a thread cannot be ended from outside: let it out after the check
        release = threading.Event()
        monkeypatch.setattr(StuckStream, "next_batch", lambda self, n: release.wait() and None)
    loader = make_loader(mixed(files), tok, kind=StuckStream, worker=worker, stall_timeout=0.5)
    handle = loader._worker.thread if worker == "thread" else loader._worker.process
    try:
        with pytest.raises(DataWorkerFailed, match="stalled"):
            loader.next_step()
    finally:
        if worker == "thread":
            release.set()
        loader.close()  # a stalled process is ended here
    handle.join(timeout=30)
    assert not handle.is_alive()


KILLED_PARENT = """
import os, signal, sys, time
from pgs.runtime.data import DataConfig, TrainStream
from pgs.runtime.data.loader import StepLoader

POINT, FOLDER = sys.argv[1], sys.argv[2]


def mark(name, text=""):
    with open(os.path.join(FOLDER, name + ".part"), "w") as f:
        f.write(text)
    os.rename(os.path.join(FOLDER, name + ".part"), os.path.join(FOLDER, name))


class BigStream(TrainStream):
    \"\"\"A pickled stream larger than a pipe's buffer (as any real tokenizer makes it), so
    that Process.start() writes until the worker reads.\"\"\"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ballast = bytes(4 << 20)


if __name__ == "__mp_main__" and POINT == "reading":
    # the worker imports this module before it reads its process object: held here until
    # the parent is killed
    mark("worker", str(os.getpid()))
    while not os.path.exists(os.path.join(FOLDER, "go")):
        time.sleep(0.01)

if __name__ == "__main__":
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained({tokenizer!r})
    stream = BigStream(DataConfig(sources=[{path!r}], max_seq_len=160), tok, pack_window=16)
    loader = StepLoader(stream, 2, 1, "cpu")
    mark("started")
    if POINT != "reading":
        mark("worker", str(loader._worker.process.pid))
    if POINT in ("step", "connecting"):
        loader.next_step()
    if POINT == "connecting":  # a restart (a resume), held between connecting and the request
        import multiprocessing.reduction

        def held(*args):
            mark("parent")
            signal.pause()

        multiprocessing.reduction.sendfds = held
        loader.load_state_dict(loader.state_dict())
    mark("parent")
    signal.pause()
"""


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


@pytest.mark.parametrize("point", ["reading", "started", "step", "connecting"])
def test_a_killed_parent_takes_its_worker_process_with_it_silently(files, tmp_path, point):
    """A SIGKILLed training process leaves no worker holding its pipes open (a caller waiting
    for its output would hang), and nothing on its stderr: killed while the worker reads its
    process object (the parent still in Process.start()), right after the start, after a
    step, or while it asks the fork server for a worker again.  The stderr pipe is read to
    its end, when every process that inherited it (the worker, the fork server,
    multiprocessing's resource tracker) is gone."""
    import subprocess

    script = tmp_path / "killed.py"
    script.write_text(KILLED_PARENT.format(tokenizer=os.path.abspath(TOKENIZER), path=files[0]))
    marks = tmp_path / "marks"
    marks.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), point, str(marks)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        there = marks / ("worker" if point == "reading" else "parent")
        wait_until(lambda: there.exists() or parent.poll() is not None, f"the parent at {point!r}", limit=120)
        assert parent.poll() is None, parent.stderr.read()[-2000:]
        # reading: the worker is held before it reads, so the parent is still writing it
        assert (marks / "started").exists() == (point != "reading")
        parent.kill()
    finally:
        parent.kill()
        parent.wait()
    (marks / "go").touch()
    _, stderr = parent.communicate(timeout=120)  # to the end: every holder of the pipe ended
    assert parent.returncode == -9
    worker = int((marks / "worker").read_text())
    wait_until(lambda: _gone(worker), "the worker process ending")
    assert "Traceback" not in stderr and "Error" not in stderr, stderr[-2000:]


# -- close ---------------------------------------------------------------------------------
@pytest.mark.parametrize("worker", WORKERS)
def test_close_is_idempotent_and_ends_the_worker(files, tok, worker):
    loader = make_loader(mixed(files), tok, ahead=1, worker=worker)
    loader.next_step()
    read_ahead(loader, 1)  # the worker is waiting for room
    handle = loader._worker.thread if worker == "thread" else loader._worker.process
    loader.close()
    assert not handle.is_alive()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.next_step()
    with pytest.raises(RuntimeError, match="closed"):
        loader.load_state_dict(loader.state_dict())
    with make_loader(mixed(files), tok, worker=worker) as other:
        handle = other._worker.thread if worker == "thread" else other._worker.process
    assert not handle.is_alive()


def test_a_worker_thread_tokenizes_with_its_own_tokenizer(files, tok):
    stream = TrainStream(mixed(files), tok, pack_window=16)
    with StepLoader(stream, 2, 1, "cpu", worker="thread") as loader:
        assert stream.tokenizer is not tok and stream.tokenizer.chat_template == tok.chat_template
        loader.next_step()
    assert StepLoader(TrainStream(mixed(files), tok), 1, 1, "cpu", threaded=False).stream.tokenizer is tok


def test_bad_arguments(files, tok):
    with pytest.raises(ValueError, match="grad_accum"):
        make_loader(mixed(files), tok, grad_accum=0)
    with pytest.raises(ValueError, match="ahead"):
        make_loader(mixed(files), tok, ahead=0)
    with pytest.raises(ValueError, match="worker"):
        make_loader(mixed(files), tok, worker="fiber")


def test_the_worker_keeps_a_window_of_steps_unless_bounded(files, tok):
    with make_loader(mixed(files), tok, micro_batch=1, grad_accum=1, worker="thread") as auto:
        auto.next_step()
        read_ahead(auto)
        wait_until(lambda: auto._worker.queue.full(), "the thread worker filling its queue")
        per_window = loader_module.window_steps(auto.stream.state_dict(), 1)
        assert per_window > 2 and auto._worker.queue.maxsize >= per_window + 1
    with make_loader(mixed(files), tok, micro_batch=1, grad_accum=1, ahead=2, worker="thread") as bounded:
        bounded.next_step()
        read_ahead(bounded)
        assert bounded._worker.queue.maxsize == 2
    with make_loader(mixed(files), tok, micro_batch=1, grad_accum=1, worker="process") as auto:
        auto.next_step()
        read_ahead(auto, 4)  # more than the two it starts with: it measured a window


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("worker", WORKERS)
def test_cuda_steps_are_on_the_device_and_equal_the_cpu_path(files, tok, worker):
    device = torch.device("cuda")
    want, want_states = [], []
    with make_loader(mixed(files), tok, threaded=False) as cpu_path:
        for _ in range(12):
            want.append(cpu_path.next_step())
            want_states.append(cpu_path.state_dict())
    for threaded in (True, False):
        stream = TrainStream(mixed(files), tok, pack_window=16)
        with StepLoader(stream, 2, 3, device, threaded=threaded, worker=worker) as loader:
            for w, state in zip(want, want_states):
                got = loader.next_step()
                for b in got:
                    assert b.input_ids.is_cuda and b.labels.is_cuda and b.position_ids.is_cuda
                    assert all(c.is_cuda for c in b.cu_seqlens)
                torch.cuda._sleep(100_000)  # compute for the next copy to overlap
                assert_same_step(got, w)
                assert loader.state_dict() == state


# -- the fast paths against their plain definitions ------------------------------------------
def reference_mask(offsets, spans):
    """encode_chat's mask rule as a scan (its original form)."""
    mask = [False] * len(offsets)
    k = 0
    for i, (start, stop) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if stop > spans[k][0] and stop > start:
            mask[i] = True
    return mask


def test_vectorised_mask_equals_the_scan_on_any_offsets():
    rng = random.Random(0)
    for _ in range(3000):
        offsets = []
        for _ in range(rng.randint(0, 12)):
            start = rng.randint(0, 30)
            offsets.append((start, max(start + rng.randint(-1, 4), 0)))
        if rng.random() < 0.5:
            offsets.sort()
        spans = [tuple(sorted((rng.randint(0, 30), rng.randint(0, 30)))) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.5:
            spans.sort()
        array = np.array(offsets, dtype=np.int64).reshape(-1, 2)
        assert chat.train_mask(array, spans).tolist() == reference_mask(offsets, spans)


def test_batch_encoding_equals_the_tokenizer_call_one_by_one(tok, strict_tok):
    samples = generate(40, seed=5, weather_share=0.5)
    samples[7]["messages"][0]["content"] += " POISON"
    conversations = [(s["messages"], s.get("tools")) for s in samples]
    for tokenizer in (tok, strict_tok):
        batch = chat.encode_chats(tokenizer, conversations)
        for (messages, tools), got in zip(conversations, batch):
            try:
                text, spans = chat.assistant_spans(tokenizer, messages, tools)
            except DataError as err:
                assert type(got) is type(err) and str(got) == str(err)
                continue
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            want = (list(encoded["input_ids"]), reference_mask(encoded["offset_mapping"], spans))
            assert got == want and encode_chat(tokenizer, messages, tools) == want
    assert isinstance(chat.encode_chats(strict_tok, conversations)[7], DataError)


def test_a_configured_tokenizer_is_called_through_its_wrapper(tok):
    padded = AutoTokenizer.from_pretrained(TOKENIZER)
    padded(["a", "bb b"], padding=True)  # leaves padding switched on in the Rust tokenizer
    assert chat._backend(padded) is None
    messages = generate(1, seed=9)[0]["messages"]
    assert encode_chat(padded, messages) == encode_chat(tok, messages)


def reference_collate(rows, pad_id, seq_len=None):
    """collate in its original per-document form (padding positions 0)."""
    used = [sum(len(d) for d in row) for row in rows]
    width = max([seq_len or 0, *used, 1])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    cu, trained = [], 0
    for r, row in enumerate(rows):
        at, bounds = 0, [0]
        for doc in row:
            n = len(doc)
            ids[r, at:at + n] = torch.tensor(doc.input_ids, dtype=torch.long)
            labels[r, at:at + n] = torch.tensor(doc.labels(), dtype=torch.long)
            pos[r, at:at + n] = torch.arange(n)
            at += n
            bounds.append(at)
            trained += doc.num_trained
        cu.append(torch.tensor(bounds, dtype=torch.int32))
    return ids, labels, pos, cu, sum(len(r) for r in rows), trained, sum(used)


def test_collate_equals_its_per_document_form():
    rng = random.Random(1)

    def doc(n):
        return Document(tuple(rng.randint(0, 700) for _ in range(n)), tuple(rng.random() < 0.5 for _ in range(n)))

    for _ in range(500):
        rows = [[doc(rng.choice([0, 1, 2, 3, 7, 20])) for _ in range(rng.randint(0, 4))]
                for _ in range(rng.randint(1, 4))]
        seq_len = rng.choice([None, 5, 40])
        got = collate(rows, 3, seq_len)
        ids, labels, pos, cu, docs, trained, tokens = reference_collate(rows, 3, seq_len)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.labels, labels)
        for r, row in enumerate(rows):  # the documents' positions (padding's are packing's to define)
            n = sum(len(d) for d in row)
            assert torch.equal(got.position_ids[r, :n], pos[r, :n])
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got.cu_seqlens, cu))
        assert (got.num_docs, got.num_trained_tokens, got.num_tokens) == (docs, trained, tokens)
