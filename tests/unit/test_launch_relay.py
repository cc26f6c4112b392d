"""``pgs run --nproc N``'s relay of torchrun's stderr (issue 29, item 5): after a signal the
launcher passed on, torchrun's ``SignalException`` traceback is dropped; everything else
(worker lines, other tracebacks, and all of it when no signal was passed on) goes through."""

from __future__ import annotations

import io

from pgs.runtime.dist.launch import relay_stderr

SIGNAL_TRACEBACK = """\
Traceback (most recent call last):
  File "torch/distributed/run.py", line 900, in main
    run(args)
  File "torch/distributed/elastic/multiprocessing/api.py", line 80, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 41 got signal: 15
"""
OTHER_TRACEBACK = """\
Traceback (most recent call last):
  File "pgs/runtime/loop/train.py", line 1, in <module>
    boom()
RuntimeError: a real bug

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "x.py", line 2, in <module>
ValueError: and its consequence
"""


def relay(text: str, signalled: bool) -> str:
    out = io.StringIO()
    relay_stderr(io.BytesIO(text.encode()), out, lambda: signalled)
    return out.getvalue()


def test_the_agents_signal_traceback_is_dropped_after_a_forwarded_signal():
    worker = "pgs: stopped at step 7 (signal 15); checkpoint runs/x/step_7\n"
    text = "W1201 torchrun: Received Signals.SIGTERM death signal, shutting down workers\n" + worker
    assert relay(text + SIGNAL_TRACEBACK, signalled=True) == text
    assert relay(SIGNAL_TRACEBACK + worker, signalled=True) == worker


def test_everything_else_goes_through_unchanged():
    worker = "step 5/10  loss 1.2\n"
    assert relay(worker + OTHER_TRACEBACK + worker, signalled=True) == worker + OTHER_TRACEBACK + worker
    assert relay(SIGNAL_TRACEBACK + worker, signalled=False) == SIGNAL_TRACEBACK + worker
    cut = "Traceback (most recent call last):\n  File \"a.py\", line 1\n"  # the stream ended mid-traceback
    assert relay(worker + cut, signalled=True) == worker + cut
