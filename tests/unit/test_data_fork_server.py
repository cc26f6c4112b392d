"""The data worker's fork server is silent about a process object cut short by a parent that is
gone, and only about that: multiprocessing's own read (``spawn._main``) is run here on a pipe,
as a forked child runs it (the subprocess case is tests/integration/test_data_loader.py)."""

from __future__ import annotations

import contextlib
import multiprocessing.reduction
import multiprocessing.spawn
import os
import pickle
import socket
import sys

import pytest


@pytest.fixture
def fork_server(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the import installs its hook: undone after
    from pgs.runtime.data import fork_server

    return fork_server


@contextlib.contextmanager
def read_process_object(data: bytes, parent_lives: bool):
    """``spawn._main`` on a pipe holding ``data``: the error it raises and the traceback, while
    the child's sentinel is open (as it is in a forked child until it exits)."""
    child_r, parent_w = os.pipe()
    os.write(parent_w, data)
    sentinel = os.dup(child_r)
    if not parent_lives:
        os.close(parent_w)
    try:
        try:
            multiprocessing.spawn._main(child_r, sentinel)
        except BaseException as err:  # noqa: BLE001 - the error is what is checked
            yield err, err.__traceback__
        else:
            raise AssertionError("the process object was read")
    finally:
        os.close(sentinel)
        if parent_lives:
            os.close(parent_w)


def test_a_process_object_cut_short_by_a_gone_parent_is_quiet(fork_server):
    whole = pickle.dumps({}) + pickle.dumps(("a process object", bytes(1000)))
    for data in (b"", whole[:-10]):  # nothing sent (EOFError), or part of it (truncated)
        with read_process_object(data, parent_lives=False) as (error, tb):
            assert isinstance(error, (EOFError, pickle.UnpicklingError))
            assert fork_server.parent_gone(error, tb)


def test_other_errors_and_a_living_parent_are_printed(fork_server, monkeypatch):
    with read_process_object(pickle.dumps({}) + b"\xff", parent_lives=True) as (error, tb):  # bad data
        assert isinstance(error, pickle.UnpicklingError)
        assert not fork_server.parent_gone(error, tb)
    try:
        raise EOFError("raised elsewhere")
    except EOFError as err:
        assert not fork_server.parent_gone(err, err.__traceback__)
    left, right = socket.socketpair()
    right.close()  # a client gone before its request, outside the fork server's loop
    with left, pytest.raises(EOFError) as received:
        multiprocessing.reduction.recvfds(left, 4)
    assert not fork_server.parent_gone(received.value, received.value.__traceback__)
    printed = []
    monkeypatch.setattr(fork_server, "_previous", lambda *info: printed.append(info[1]))
    real = ValueError("a real error")
    with read_process_object(b"", parent_lives=False) as (gone, gone_tb):
        for err, trace in ((real, None), (gone, gone_tb)):
            fork_server._excepthook(type(err), err, trace)
    assert printed == [real]
