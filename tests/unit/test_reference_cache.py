"""The reference log-probs cache's writes: the checkpoint's durable publish and its full-disk guard."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from pgs.errors import DiskFull
from pgs.runtime.store import reference as cache

PRINT = {"model": "m", "data": "d", "template": "t", "tokenizer": "k", "max_seq_len": "192"}


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_disk_full_and_keeps_the_previous_cache(tmp_path, monkeypatch):
    path = cache.cache_path(str(tmp_path))
    old = {"train": torch.randn(3, 2), "eval": torch.randn(1, 2)}
    cache.save(path, old, PRINT)
    monkeypatch.setattr(cache, "write_safetensors", _full)
    with pytest.raises(DiskFull, match=r"disk full while writing the reference log-probs cache .*reference: it needs"):
        cache.save(path, {"train": torch.randn(5, 2), "eval": torch.randn(2, 2)}, PRINT)
    assert sorted(os.listdir(tmp_path)) == [cache.CACHE_DIR]  # the temporary folder is gone
    kept = cache.load(path, PRINT)
    assert torch.equal(kept["train"], old["train"]) and torch.equal(kept["eval"], old["eval"])


def test_other_write_errors_stay_what_they_are(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cache, "write_safetensors", broken)
    with pytest.raises(OSError, match="Input/output"):
        cache.save(cache.cache_path(str(tmp_path)), {"train": torch.zeros(1, 2)}, PRINT)


def test_a_folder_that_can_no_longer_be_written_is_said_as_such(tmp_path, monkeypatch):
    """Permission taken away (or a read-only remount) ends the run like a full disk (exit 84),
    with its own words."""
    from pgs.errors import DiskFull

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cache, "write_safetensors", denied)
    with pytest.raises(DiskFull, match="can no longer be written .* reference log-probs cache"):
        cache.save(cache.cache_path(str(tmp_path)), {"train": torch.zeros(1, 2)}, PRINT)


def test_a_killed_saves_leftovers_are_removed(tmp_path):
    path = cache.cache_path(str(tmp_path))
    cache.save(path, {"train": torch.zeros(2, 2), "eval": torch.zeros(0, 2)}, PRINT)
    for name in (".reference.tmp-123", "reference.old-456"):
        os.makedirs(tmp_path / name)
    (tmp_path / cache.CACHE_DIR / f"{cache.CACHE_FILE}.tmp-789").write_bytes(b"x")
    (tmp_path / "step_4").mkdir()  # not the cache's: kept
    cache.remove_stale_temporaries(path)
    assert sorted(os.listdir(tmp_path)) == [cache.CACHE_DIR, "step_4"]
    assert os.listdir(tmp_path / cache.CACHE_DIR) == [cache.CACHE_FILE]
    assert cache.load(path, PRINT)["train"].shape == (2, 2)


def test_the_key_names_the_fingerprint():
    assert cache.key(PRINT) == cache.key(dict(reversed(list(PRINT.items()))))
    assert cache.key(PRINT) != cache.key({**PRINT, "data": "other"})
