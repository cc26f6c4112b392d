"""The resource preflight (exit 83): memory the run will need against what the device has free,
and disk for its checkpoints (pgs.runtime.tools.resources).

A ``data.max_seq_len`` within the model's positions but beyond the host's memory used to pass
``pgs validate`` and then die under the kernel's OOM killer (exit 137, no message); both
commands now refuse it with one line and exit 83 before a model is built.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch

from pgs.cli import main
from pgs.errors import PreflightRefused
from pgs.runtime.spec.load import load_spec
from pgs.runtime.tools import resources as R
from helpers import cli_error, config_toml, cpu_spec
from tiny import shape_table

LONG = config_toml(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1048576)


def test_an_impossible_max_seq_len_is_refused_by_validate_and_run_with_exit_83(tmp_path, capsys):
    spec = cpu_spec(tmp_path, model=LONG)
    sets = ["--set", "data.max_seq_len=524288"]  # 2 rows × 2 layers × 512k² × 4 B of masks: ~4 TiB
    code_v, line_v = cli_error(["validate", str(spec), *sets], capsys)
    code_r, line_r = cli_error(["run", str(spec), *sets], capsys)
    assert (code_v, code_r) == (83, 83)
    assert line_v.startswith("pgs: error: data.max_seq_len = 524288: 2 rows × 524288 tokens per micro-batch")
    assert "attention masks" in line_v and "free on cpu" in line_v
    assert line_r.split(" at the peak")[0] == line_v.split(" at the peak")[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_same_spec_at_a_sane_length_passes(tmp_path):
    spec = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=96"])
    prediction = R.check_host(spec)
    assert prediction is not None and 0 < prediction.peak < 2**30
    assert prediction.checkpoint > 0


def test_memory_refusal_names_the_field_and_the_numbers(tmp_path):
    spec = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=4096"])
    prediction = R.predict(spec, torch.device("cpu"))
    R.check_memory(spec, prediction, torch.device("cpu"), available=prediction.peak, where="x has")
    with pytest.raises(PreflightRefused) as err:
        R.check_memory(spec, prediction, torch.device("cpu"), available=prediction.peak - 1, where="the host has")
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 83
    assert text.startswith("data.max_seq_len = 4096: 2 rows × 4096 tokens per micro-batch need at least")
    assert "lower data.max_seq_len" in text


def _saved_square_bytes(implementation: str, rows: int, seq: int) -> tuple[int, object]:
    """Bytes of the [.., S, S] tensors autograd saves for a packed forward of a tiny Qwen3."""
    from pgs.runtime.model.build import final_hidden
    from pgs.runtime.model.build import build_model

    cfg = shape_table(max_position_embeddings=4096, tie_word_embeddings=True, vocab_size=64)
    model = build_model(config=cfg, dtype="float32", attn_implementation=implementation, device="cpu")
    ids = torch.randint(0, 64, (rows, seq))
    pos = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)])[None].expand(rows, seq).contiguous()
    seen, sizes = set(), collections.Counter()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.dim() >= 2 and t.shape[-1] == seq and t.shape[-2] == seq:
            seen.add(ptr)
            sizes["square"] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        final_hidden(model, ids, pos)
    return sizes["square"], model.config


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attention_matrices_match_what_autograd_saves_on_the_cpu(implementation):
    rows, seq = 2, 256
    saved, config = _saved_square_bytes(implementation, rows, seq)
    predicted = R.attention_matrix_bytes(config, rows, seq, dtype_bytes=4, implementation=implementation,
                                         device_type="cpu", packed=True, varlen_kernel=False)
    # beyond what autograd saves: the boolean mask (rows·S²), and eager's one additive fp32 mask
    once = rows * seq * seq * (1 + (4 if implementation == "eager" else 0))
    assert predicted - once == saved > 0


def test_no_square_term_for_unpacked_rows_or_the_varlen_kernel():
    cfg = type("C", (), {"num_hidden_layers": 2, "num_attention_heads": 4})()
    common = dict(dtype_bytes=2, implementation="sdpa", device_type="cuda")
    assert R.attention_matrix_bytes(cfg, 2, 1024, packed=False, varlen_kernel=False, **common) == 0
    assert R.attention_matrix_bytes(cfg, 2, 1024, packed=True, varlen_kernel=True, **common) == 0
    full = R.attention_matrix_bytes(cfg, 2, 1024, packed=True, varlen_kernel=False, **common)
    ckpt = R.attention_matrix_bytes(cfg, 2, 1024, packed=True, varlen_kernel=False, checkpointing="full", **common)
    assert 0 < ckpt < full


def test_disk_refusals(tmp_path, monkeypatch):
    R.check_disk(str(tmp_path / "a" / "b"), 1024)
    assert not (tmp_path / "a").exists()  # judged by the folder above; nothing created
    with pytest.raises(PreflightRefused, match="checkpoints need about"):
        R.check_disk(str(tmp_path / "run"), 1 << 60)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(PreflightRefused, match="cannot be created"):
                R.check_disk(str(locked / "run"), 1)
        finally:
            locked.chmod(0o700)


def test_disk_copies_follow_what_checkpoint_keeps():
    """keep newest + the one written beside them, + best, + export; keep = 0 (all) asks for 3."""
    from types import SimpleNamespace as NS

    assert R.disk_copies(NS(every=5, last=True, keep=1, best_metric="", export=False)) == 2
    assert R.disk_copies(NS(every=5, last=True, keep=2, best_metric="eval_loss", export=True)) == 5
    assert R.disk_copies(NS(every=5, last=True, keep=0, best_metric="", export=False)) == R.DISK_COPIES
    # no periodic saves and none after the last step (checkpoint.last = false): only the exports
    assert R.disk_copies(NS(every=0, last=False, keep=1, best_metric="", export=False)) == 0
    assert R.disk_copies(NS(every=0, last=False, keep=1, best_metric="", export=True)) == 1
    assert R.disk_copies(NS(every=5, last=False, keep=1, best_metric="", export=False)) == 2


def test_a_resumed_runs_step_folders_count_towards_keep(tmp_path):
    """Resuming a run that keeps one checkpoint: the one on disk is not free space to find (it
    asked for 2 × 23 GiB free with step_6's 23 GiB already on a 64 GiB disk, and refused the
    8B recipe's resume).  At most ``keep`` folders count; keep = 0 still asks for 3."""
    from types import SimpleNamespace as NS

    one = NS(every=6, last=True, keep=1, best_metric="", export=False)
    two = NS(every=6, last=True, keep=2, best_metric="eval_loss", export=True)
    assert R.disk_copies(one, str(tmp_path / "absent")) == 2
    (tmp_path / "step_6").mkdir()
    (tmp_path / "best").mkdir()  # replaced beside the old one: still needs its room
    assert R.disk_copies(one, str(tmp_path)) == 1
    assert R.disk_copies(two, str(tmp_path)) == 4
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_18").mkdir()
    assert R.disk_copies(one, str(tmp_path)) == 1 and R.disk_copies(two, str(tmp_path)) == 3
    assert R.disk_copies(NS(every=6, last=True, keep=0, best_metric="", export=False), str(tmp_path)) == R.DISK_COPIES


def test_device_limit_is_the_room_a_cuda_spec_is_checked_against_even_without_the_device(tmp_path):
    """memory.device_limit_gib caps what the run may reserve, so the preflight checks the
    prediction against the cap, on a host that has no GPU as well (pgs validate on a laptop)."""
    spec = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=4096"])
    prediction = R.predict(spec, torch.device("cpu"))
    below = prediction.peak / R.GiB * 0.9
    capped = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=4096", f"memory.device_limit_gib={below}"])
    R.check_memory(capped, prediction, torch.device("cpu"), available=None)  # the cap is a CUDA allocator's
    with pytest.raises(PreflightRefused) as err:
        R.check_memory(capped, prediction, torch.device("cuda"), available=None)
    assert f"memory.device_limit_gib = {below:g} allows {below:.2f} GiB free on cuda" in str(err.value)
    roomy = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=4096", f"memory.device_limit_gib={below * 2}"])
    R.check_memory(roomy, prediction, torch.device("cuda"), available=prediction.peak)


@pytest.mark.parametrize("value", ["-1", '"big"'])
def test_a_bad_device_limit_names_the_field(tmp_path, capsys, value):
    spec = cpu_spec(tmp_path, model=LONG)
    code, line = cli_error(["validate", str(spec), "--set", f"memory.device_limit_gib={value}"], capsys)
    assert code == 2 and line.startswith("pgs: error: ") and "memory.device_limit_gib" in line


def test_a_device_limit_on_a_cpu_run_is_refused_not_ignored(tmp_path, capsys):
    spec = cpu_spec(tmp_path, model=LONG)
    sets = ["--set", "memory.device_limit_gib=4", "--set", "train.device=cpu"]
    code_v, line_v = cli_error(["validate", str(spec), *sets], capsys)
    code_r, line_r = cli_error(["run", str(spec), *sets], capsys)
    assert (code_v, code_r) == (2, 2) and line_v == line_r
    assert line_v == 'pgs: error: memory.device_limit_gib: 4 caps CUDA\'s caching allocator, and train.device is "cpu" (set it to 0)'
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="train.device = auto is the CPU only without CUDA")
def test_a_device_limit_on_an_auto_device_that_is_the_cpu_is_refused_by_run(tmp_path, capsys):
    spec = cpu_spec(tmp_path, model=LONG)
    code, line = cli_error(["run", str(spec), "--set", "memory.device_limit_gib=4", "--set", "train.device=auto"],
                           capsys)
    assert code == 2 and line.startswith("pgs: error: memory.device_limit_gib: 4 caps CUDA's caching allocator, "
                                         "and this run trains on cpu")


def test_validate_shows_the_predicted_peak_and_the_cap(tmp_path, capsys):
    from pgs.runtime.spec.preflight import check_resources

    spec = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=96", "memory.device_limit_gib=3",
                                                   "train.device=cuda"])  # validated here, run on a GPU elsewhere
    memory = check_resources(spec)["memory"]
    peak = R.predict(spec, torch.device("cuda")).peak
    assert memory == (f"predicted peak {peak / 2**30:.2f} GiB per process (pgs profile; a lower bound), "
                      "allocator capped at 3 GiB (memory.device_limit_gib)")


def test_a_background_save_needs_host_memory_for_one_checkpoint(tmp_path):
    """``checkpoint.background``: the snapshot (one checkpoint) plus the run's other host memory
    (on the CPU its peak) against the host's free memory; one line, exit 83."""
    spec = load_spec(cpu_spec(tmp_path, model=LONG), ["data.max_seq_len=96", "checkpoint.background=true"])
    prediction = R.predict(spec, torch.device("cpu"))
    need = prediction.checkpoint + prediction.peak
    R.check_snapshot(prediction, torch.device("cpu"), available=need, where="x has")
    with pytest.raises(PreflightRefused) as err:
        R.check_snapshot(prediction, torch.device("cpu"), available=need - 1, where="the host has")
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 83
    assert text.startswith("checkpoint.background: a save's host snapshot takes ")
    assert "the host has" in text and "set checkpoint.background = false" in text
    # on a GPU the run's peak is the device's, not the host's
    R.check_snapshot(prediction, torch.device("cuda"), available=prediction.checkpoint, where="x has")
    assert R.check_host(spec) is not None  # this host holds it


def test_a_gpu_run_whose_pinned_host_memory_the_host_lacks_is_refused(tmp_path):
    """``memory.offload_optimizer`` on a GPU: the page-locked state and inputs against the host's
    free memory (page-locked memory cannot be swapped); one line naming the shortfall, exit 83.
    A CPU run's state is part of its peak (check_memory), so nothing more is asked there."""
    spec = load_spec(cpu_spec(tmp_path, model=LONG), [
        "data.max_seq_len=96", "memory.gradient_release=true", "memory.offload_optimizer=true",
        "optimizer.alias=lion8bit", "optimizer.clip=0"])
    prediction = R.predict(spec, torch.device("cuda"))
    assert prediction.host >= prediction.memory["host_state"] > 0
    R.check_pinned(prediction, torch.device("cuda"), available=prediction.host, where="x has")
    with pytest.raises(PreflightRefused) as err:
        R.check_pinned(prediction, torch.device("cuda"), available=prediction.host - 2**20, where="the host has")
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 83
    assert text.startswith("memory.offload_optimizer: the run keeps ")
    assert "the host has" in text and "0.00 GiB short" in text
    R.check_pinned(prediction, torch.device("cpu"), available=0, where="x has")  # the CPU: part of the peak
