"""A busy machine: OpenMP waits passively under the ``pgs`` command, and a run uses no more
intra-op threads than the CPUs it may use (affinity mask, control group quota)."""

from __future__ import annotations

import torch

from pgs import cli
from pgs.runtime import process


def test_pgs_sets_a_passive_openmp_wait_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli._openmp_waits_passively()
    assert process.variable("OMP_WAIT_POLICY") == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli._openmp_waits_passively()
    assert process.variable("OMP_WAIT_POLICY") == "ACTIVE"


def _files(monkeypatch, files: dict[str, str]) -> None:
    monkeypatch.setattr(process, "_read", lambda path: files.get(path))


def test_cgroup_quota_v2_v1_and_none(monkeypatch):
    _files(monkeypatch, {"/sys/fs/cgroup/cpu.max": "150000 100000"})
    assert process._cgroup_cpu_quota() == 1.5
    _files(monkeypatch, {"/sys/fs/cgroup/cpu.max": "max 100000"})
    assert process._cgroup_cpu_quota() is None
    _files(monkeypatch, {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "300000", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert process._cgroup_cpu_quota() == 3.0
    _files(monkeypatch, {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert process._cgroup_cpu_quota() is None
    _files(monkeypatch, {})
    assert process._cgroup_cpu_quota() is None


def test_available_cpus_is_the_affinity_mask_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(process.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    _files(monkeypatch, {"/sys/fs/cgroup/cpu.max": "150000 100000"})
    assert process.available_cpus() == 2  # 1.5 CPUs of time: two threads, rounded up
    _files(monkeypatch, {})
    assert process.available_cpus() == 8
    _files(monkeypatch, {"/sys/fs/cgroup/cpu.max": "5000 100000"})
    assert process.available_cpus() == 1


def test_fit_cpu_threads_lowers_never_raises(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(process, "available_cpus", lambda: 1)
        assert process.fit_cpu_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(process, "available_cpus", lambda: 64)
        assert process.fit_cpu_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
