"""bench/ranks.py's ``run_bounded``: the bench's one way to run a child under a timeout.  Past
the timeout the child gets SIGTERM and, after ``grace`` seconds, SIGKILL; what it printed before
is kept either way (the bench summarizes the steps a cut-off run logged)."""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.ranks import run_bounded  # noqa: E402

# prints a line, then sleeps; on SIGTERM prints "stopping" and exits 143 (as pgs run does)
CHILD = """
import signal, sys, time
def stop(signum, frame):
    print("stopping", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("first", flush=True)
time.sleep(60)
"""


def test_a_child_within_its_time_is_left_alone():
    proc, timed_out = run_bounded([sys.executable, "-c", "print('done')"], 30)
    assert (proc.returncode, timed_out, proc.stdout.strip()) == (0, False, "done")


def test_past_the_timeout_sigterm_then_the_grace():
    t0 = time.time()
    proc, timed_out = run_bounded([sys.executable, "-c", CHILD], 3, grace=30)
    assert timed_out and proc.returncode == 143 and proc.stdout.split() == ["first", "stopping"]
    assert time.time() - t0 < 20  # it stopped when asked, not at the end of the grace


def test_no_grace_kills_at_once():
    t0 = time.time()
    proc, timed_out = run_bounded([sys.executable, "-c", CHILD.replace("sys.exit(143)", "time.sleep(60)")], 3, grace=0)
    assert timed_out and proc.returncode == -9 and proc.stdout.split()[0] == "first"
    assert time.time() - t0 < 20
