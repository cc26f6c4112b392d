"""Checkpoint folders: round trip, completeness checks, resume selection, purge, export."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

import pgs.func as pf
from helpers import CountingReader
from pgs.runtime.store import checkpoint as ckpt
from pgs.runtime.store import export as export_mod
from pgs.runtime.loop import train as train_mod
from pgs.runtime.optim.bound import bind
from pgs.runtime.store.export import export_hf
from pgs.runtime.model.build import build_model

ARCH = dict(model_type="qwen3", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
            vocab_size=50)


def tiny(tied: bool = True, seed: int = 0):
    return build_model(config={**ARCH, "tie_word_embeddings": tied}, init_seed=seed)


def trained_pair(seed: int = 0):
    model = tiny(seed=seed)
    bound = bind(pf.adamw(1e-2), model)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    bound.step()
    bound.zero_grad()
    return model, bound


def write(run_dir, step, model, bound, **trainer):
    return ckpt.save(str(run_dir), step, model=model, optimizer_state=bound.state_dict(),
                     rng=ckpt.capture_rng(), trainer={"note": "x", **trainer}, spec_toml="[train]\n")


def test_round_trip_restores_weights_state_and_counters(tmp_path):
    model, bound = trained_pair()
    folder = write(tmp_path, 5, model, bound, data={"window": 3})
    assert ckpt.problem(folder) is None
    saved = ckpt.load(folder)
    assert saved.step == 5 and saved.trainer["data"] == {"window": 3}
    # tied embedding stored once, recorded as an alias
    assert saved.trainer["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}

    fresh, fresh_bound = trained_pair(seed=1)
    ckpt.load_model_state(fresh, saved.model, saved.trainer["aliases"])
    fresh_bound.load_state_dict(saved.optimizer)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied, same storage
    for k, v in bound.state_dict().items():
        assert torch.equal(v, fresh_bound.state_dict()[k]), k


def test_model_state_copies_into_parameters_in_place(tmp_path):
    model, bound = trained_pair()
    saved = ckpt.load(write(tmp_path, 1, model, bound))
    other, _ = trained_pair(seed=2)
    before = {n: p for n, p in other.named_parameters()}
    ckpt.load_model_state(other, saved.model, saved.trainer["aliases"])
    assert all(p is before[n] for n, p in other.named_parameters())  # a bound optimizer keeps its params


def test_problem_names_each_kind_of_damage(tmp_path):
    model, bound = trained_pair()
    folder = write(tmp_path, 1, model, bound)
    weights = os.path.join(folder, ckpt.MODEL_FILE)
    data = open(weights, "rb").read()

    with open(weights, "r+b") as f:  # same size, one byte flipped
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0xFF]))
    assert "sha256" in ckpt.problem(folder)
    assert ckpt.problem(folder, hashes=False) is None

    with open(weights, "wb") as f:  # truncated
        f.write(data[:100])
    assert "100 bytes" in ckpt.problem(folder)
    with open(weights, "wb") as f:
        f.write(data)

    os.remove(os.path.join(folder, ckpt.OPTIMIZER_FILE))
    assert "missing" in ckpt.problem(folder)

    os.remove(os.path.join(folder, ckpt.COMPLETE))
    assert "COMPLETE" in ckpt.problem(folder)


def test_latest_skips_incomplete_and_reports_them(tmp_path):
    model, bound = trained_pair()
    write(tmp_path, 2, model, bound)
    write(tmp_path, 10, model, bound)
    os.remove(tmp_path / "step_10" / ckpt.RNG_FILE)
    (tmp_path / "step_12").mkdir()  # a folder with nothing in it
    lines = []
    assert ckpt.latest(str(tmp_path), report=lines.append) == str(tmp_path / "step_2")
    assert len(lines) == 2 and "step_12" in lines[0] and "step_10" in lines[1]
    assert ckpt.resolve(str(tmp_path), None) is None
    assert ckpt.resolve(str(tmp_path / "empty"), "auto") is None
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.resolve(str(tmp_path), str(tmp_path / "step_10"))


def test_purge_keeps_newest_complete_and_never_best(tmp_path):
    model, bound = trained_pair()
    for step in (1, 2, 3, 4):
        write(tmp_path, step, model, bound)
    (tmp_path / "step_5").mkdir()  # newer and incomplete: kept for inspection
    export_hf(model, None, str(tmp_path / "best"))
    removed = ckpt.purge(str(tmp_path), keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["step_1", "step_2"]
    assert sorted(os.listdir(tmp_path)) == ["best", "step_3", "step_4", "step_5"]
    assert ckpt.purge(str(tmp_path), keep=0) == []


def test_stale_temporaries_are_removed(tmp_path):
    for name in (".step_4.tmp-123", ".best.tmp-9", "step_3.old-77"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_2").mkdir()
    removed = ckpt.remove_stale_temporaries(str(tmp_path))
    assert sorted(removed) == [".best.tmp-9", ".step_4.tmp-123", "step_3.old-77"]
    assert os.listdir(tmp_path) == ["step_2"]


def test_publish_replaces_an_existing_folder(tmp_path):
    for text in ("one", "two"):
        tmp = tmp_path / ".x.tmp-1"
        tmp.mkdir()
        (tmp / "f").write_text(text)
        ckpt.publish(str(tmp), str(tmp_path / "x"))
    assert (tmp_path / "x" / "f").read_text() == "two"
    assert os.listdir(tmp_path) == ["x"]


def test_rng_states_round_trip():
    noise = torch.Generator().manual_seed(5)
    states = ckpt.capture_rng(noise)
    assert all(t.dtype == torch.uint8 for t in states.values())
    a, na = torch.rand(4), torch.rand(4, generator=noise)
    ckpt.restore_rng(states, noise)
    assert torch.equal(a, torch.rand(4)) and torch.equal(na, torch.rand(4, generator=noise))


def _chunked_sha256(data: bytes, chunk: int = 8 << 20) -> str:
    """The manifest's digest as pgs.runtime.store.digest's docstring tells a user to check it."""
    import hashlib
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + chunk]).digest()
                                   for i in range(0, len(data), chunk))).hexdigest()


def test_manifest_lists_sizes_and_hashes(tmp_path, monkeypatch):
    """Sizes and chunked sha256 of every file; the safetensors files hashed as they were
    written (only the small text files are read back for the manifest)."""
    from pgs.runtime.store import digest

    read_back = []
    real = digest.file_digest
    monkeypatch.setattr(digest, "file_digest", lambda path, *a, **k: read_back.append(os.path.basename(path))
                        or real(path, *a, **k))
    model, bound = trained_pair()
    folder = write(tmp_path, 3, model, bound)
    manifest = json.loads(open(os.path.join(folder, ckpt.COMPLETE)).read())
    assert manifest["step"] == 3 and manifest["format"] == 2 and manifest["chunk_bytes"] == 8 << 20
    assert set(manifest["files"]) == {ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, ckpt.RNG_FILE, ckpt.TRAINER_FILE,
                                      ckpt.SPEC_FILE}
    for name, entry in manifest["files"].items():
        data = open(os.path.join(folder, name), "rb").read()
        assert entry["bytes"] == len(data) and entry["sha256_chunks"] == _chunked_sha256(data), name
    assert sorted(read_back) == sorted([ckpt.TRAINER_FILE, ckpt.SPEC_FILE])
    assert ckpt.problem(folder) is None


def test_a_format_1_manifest_whole_file_sha256_is_still_verified(tmp_path):
    """Checkpoints of pgs before the chunked digest (manifest format 1: one sha256 per file)
    resume as before; a flipped byte is still found; an unknown format or a bad chunk size is
    named."""
    import hashlib
    model, bound = trained_pair()
    folder = write(tmp_path, 2, model, bound)
    path = os.path.join(folder, ckpt.COMPLETE)
    manifest = json.loads(open(path).read())
    old = {"format": 1, "step": 2, "files": {
        name: {"bytes": e["bytes"], "sha256": hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()}
        for name, e in manifest["files"].items()}}
    open(path, "w").write(json.dumps(old))
    assert ckpt.problem(folder) is None
    weights = os.path.join(folder, ckpt.MODEL_FILE)
    data = bytearray(open(weights, "rb").read())
    data[-1] ^= 1
    open(weights, "wb").write(bytes(data))
    assert ckpt.problem(folder) == f"{ckpt.MODEL_FILE} does not match its sha256 in the manifest"
    open(path, "w").write(json.dumps({**manifest, "format": 3}))
    assert "manifest format 3" in ckpt.problem(folder)
    open(path, "w").write(json.dumps({**manifest, "chunk_bytes": 0}))
    assert "chunk_bytes 0" in ckpt.problem(folder)


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_with_from_pretrained(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model = tiny(tied=tied)
    export_hf(model, None, str(tmp_path / "final"), info={"step": 1})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 50, (1, 5))
    assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert json.loads((tmp_path / "final" / "pgs_export.json").read_text()) == {"step": 1}


def test_no_pickle_loads_anywhere_in_the_runtime():
    for module in (ckpt, export_mod, train_mod):
        assert "torch.load" not in inspect.getsource(module)


def test_compile_bound_save_streams_views_and_matches_save_file(tmp_path):
    """Parameters bound with compile=True are views of one flat buffer: the checkpoint writes
    them as they are, and the optimizer file equals save_file's of the copying state_dict."""
    import struct

    from safetensors.torch import load_file, save_file

    model = tiny()
    bound = bind(pf.adamw(1e-2), model, compile=True, jit=False)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    bound.step()
    bound.zero_grad()
    views = bound.state_dict(copy=False)
    copies = bound.state_dict(device="cpu")
    assert set(views) == set(copies)
    storages = [t.untyped_storage().data_ptr() for t in ckpt.model_tensors(model)[0].values()]
    assert len(set(storages)) < len(storages), "compile=True parameters should be views of a flat buffer"
    folder = ckpt.save(str(tmp_path), 1, model=model, optimizer_state=views, rng=ckpt.capture_rng(),
                       trainer={}, spec_toml="")
    save_file(copies, str(tmp_path / "ref_opt.safetensors"), metadata={"pgs": "optimizer"})
    assert (tmp_path / "step_1" / "optimizer.safetensors").read_bytes() == (tmp_path / "ref_opt.safetensors").read_bytes()

    tensors, _aliases = ckpt.model_tensors(model)
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp_path / "ref_model.safetensors"),
              metadata={"format": "pt", "pgs": "model"})
    ours, ref = (tmp_path / "step_1" / "model.safetensors").read_bytes(), (tmp_path / "ref_model.safetensors").read_bytes()
    n = struct.unpack("<Q", ours[:8])[0]
    assert ours[:8] == ref[:8] and ours[8 + n:] == ref[8 + n:]  # the metadata's key order is safetensors' hash map's
    assert json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + n])

    saved = ckpt.load(folder)
    fresh = tiny(seed=3)
    fresh_bound = bind(pf.adamw(1e-2), fresh, compile=True, jit=False)
    ckpt.load_model_state(fresh, saved.model, saved.trainer["aliases"])
    fresh_bound.load_state_dict(saved.optimizer)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for k, v in load_file(str(tmp_path / "step_1" / "optimizer.safetensors")).items():
        assert torch.equal(v, fresh_bound.state_dict()[k]), k


def test_state_dict_copy_false_shares_the_live_state():
    model, bound = trained_pair()
    views, copies = bound.state_dict(copy=False), bound.state_dict()
    leaves = {p: x for p, x in pf.leaves_with_paths(bound.state) if isinstance(x, torch.Tensor)}
    for path, x in leaves.items():
        assert views[path].data_ptr() == x.data_ptr() and torch.equal(copies[path], x)
        assert copies[path].data_ptr() != x.data_ptr()


@pytest.mark.parametrize("kind", ["bound", "compiled", "release", "release_masters"])
def test_optimizer_state_loads_into_its_own_tensors_one_entry_at_a_time(tmp_path, kind):
    """``load_state_dict`` copies each entry of the lazily read optimizer file into the state
    it already holds: the same tensors afterwards, holding the saved values, and only a few
    entries read and alive at a time (no second copy of the state beside the first)."""
    from pgs.runtime.optim.release import GradientRelease

    def make(seed):
        model = tiny(seed=seed)
        if kind.startswith("release"):
            if kind == "release_masters":
                model = model.to(torch.bfloat16)
            opt = GradientRelease(pf.adamw(1e-2), model, master_weights="fp32" if kind == "release_masters" else None)
        else:
            opt = bind(pf.adamw(1e-2), model, compile=kind == "compiled")
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = make(0)
    folder = write(tmp_path, 2, model, opt)
    fresh_model, fresh = make(1)
    held = {k: v for k, v in fresh.state_dict(copy=False).items() if not k.startswith("__")}
    reader = CountingReader(ckpt.load(folder).optimizer)
    fresh.load_state_dict(reader)
    after = fresh.state_dict(copy=False)
    for k, v in opt.state_dict().items():
        assert torch.equal(after[k], v), k
        if k in held:
            assert after[k].data_ptr() == held[k].data_ptr(), k  # the same tensor, written in place
    # a bounded few alive at once (the layout fingerprint, the entry copied, the one before it)
    assert reader.most <= 3 < len(list(reader))
    if kind == "release_masters":  # the bf16 parameters follow their loaded masters
        for n, p in fresh_model.named_parameters():
            assert torch.equal(p, dict(model.named_parameters())[n]), n


def test_a_missing_odd_or_extra_optimizer_entry_is_named(tmp_path):
    """A missing entry and an entry of another shape are named (``TreeMismatch``)."""
    from safetensors.torch import save_file

    from pgs.errors import TreeMismatch

    model, bound = trained_pair()
    d = bound.state_dict()
    key = next(k for k in d if k.endswith("mu.model.embed_tokens.weight"))
    save_file({k: v for k, v in d.items() if k != key}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(TreeMismatch, match="lacks"):
        bound.load_state_dict(ckpt.safetensors_io.read(tmp_path / "missing.safetensors"))
    save_file({**d, key: d[key][:2].contiguous()}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(TreeMismatch, match="shape"):
        bound.load_state_dict(ckpt.safetensors_io.read(tmp_path / "shape.safetensors"))
    save_file({**d, "0_extra.x": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(TreeMismatch, match="0_extra.x"):
        bound.load_state_dict(ckpt.safetensors_io.read(tmp_path / "extra.safetensors"))
