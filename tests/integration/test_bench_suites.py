"""The bench entry point (``python -m bench``): it lists its suites, every suite names a script
with a ``main``, and results default to ``bench/results/<date>-<suite>.json``.  Nothing is
measured here."""

import datetime
import importlib.util
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TODAY = datetime.date(2026, 12, 2)


def _suites():
    spec = importlib.util.spec_from_file_location("bench_suites", os.path.join(ROOT, "bench", "suites.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


S = _suites()


def test_list_names_every_suite():
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert names == list(S.SUITES)
    assert {"optim-step", "optim-8bit", "optim-muon", "sft-step", "sft-converge", "loss-memory", "fsdp",
            "data", "product", "preference", "long-context", "distill"} <= set(S.SUITES)


def test_unknown_suite_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "bench", "no-such-suite"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown suite" in out.stderr and "optim-step" in out.stderr


def test_every_suite_is_a_module_with_a_main():
    # imported in a child process: the scripts read sys.argv and set up paths at import
    code = (
        "import importlib.util, sys\n"
        "for name, path in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    spec = importlib.util.spec_from_file_location('bench_' + name.replace('-', '_'), path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    assert callable(getattr(module, 'main', None)), name\n"
        "    print(name)\n")
    args = [x for s in S.SUITES.values() for x in (s.name, s.path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == list(S.SUITES)


def test_results_default_to_a_dated_name(tmp_path):
    cmd, out = S.command("optim-step", ["--iters", "5"], results=str(tmp_path), today=TODAY)
    assert out == str(tmp_path / "2026-12-02-optim-step.json")
    assert cmd[1:] == [S.SUITES["optim-step"].path, "--iters", "5", "--out", out]
    (tmp_path / "2026-12-02-optim-step.json").touch()
    (tmp_path / "2026-12-02-optim-step-2.json").touch()
    assert S.command("optim-step", [], results=str(tmp_path), today=TODAY)[1] == str(
        tmp_path / "2026-12-02-optim-step-3.json")
    assert S.command("sft-step", [], today=TODAY)[1] == os.path.join(ROOT, "bench", "results",
                                                                       "2026-12-02-sft-step.json")


def test_out_overrides_and_positional_scripts(tmp_path):
    cmd, out = S.command("sft-step", ["--out", "/x/a.json", "--small"])
    assert out == "/x/a.json" and cmd[2:] == ["--small", "--out", "/x/a.json"]
    cmd, out = S.command("loss-memory", ["--out=/x/b.json", "--small"])
    assert out == "/x/b.json" and cmd[2:] == ["/x/b.json", "--small"]
    cmd, out = S.command("optim-8bit", ["/x/c.json", "--iters", "3"])  # the script's own form
    assert out == "/x/c.json" and cmd[2:] == ["/x/c.json", "--iters", "3"]
    cmd, out = S.command("optim-muon", ["--iters", "3"], results=str(tmp_path), today=TODAY)
    assert cmd[2:] == [str(tmp_path / "2026-12-02-optim-muon.json"), "--iters", "3"]


def test_smoke_runs_stay_out_of_bench_results():
    _, out = S.command("loss-memory", ["--small"], today=TODAY)
    assert os.path.dirname(out) == os.path.join(tempfile.gettempdir(), "pgs-bench")
    assert os.path.basename(out).startswith("2026-12-02-loss-memory")


def test_help_is_passed_through():
    cmd, out = S.command("product", ["--help"])
    assert out is None and cmd[1:] == [S.SUITES["product"].path, "--help"]
