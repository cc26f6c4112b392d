"""``memory.offload_optimizer``: the release's chain state in host memory, streamed through device
staging slots inside backward, equals the on-device release bit for bit; checkpoints are the
same and a resume is exact; refused without gradient release (with several processes it is
``ShardedOffloadedRelease``: tests/integration/test_fsdp_offload.py).

On the CPU the "device" and the host coincide, but the staging path runs all the same: the
state lives in each group's host buffer, is copied into a staging slot, stepped there and
copied back (``StateStager``).  The ``cuda`` tests run the side streams and events."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

import pgs.func as pf
from helpers import CountingReader
from pgs.errors import InvalidArgument, SpecError
from pgs.func import tree as T
from pgs.runtime.optim import Optimizer, StepMetrics, make_optimizer
from pgs.runtime.optim.memory import single_process_refusal
from pgs.runtime.optim.offload import OffloadedRelease, StateStager, auto_slots, slot_size
from pgs.runtime.optim.release import GradientRelease
from pgs.runtime.spec.sections import MemorySpec
from test_release import VOCAB, batches, loss_of, tiny_model
from test_release_slabs import step as slab_step
from tiny import tiny_model as build_tiny

CHAINS = {  # 8-bit state on the tiny model's matrices (blocks of 64), fp32 state for AdamW
    "lion8bit": lambda: pf.lion8bit(1e-3, weight_decay=0.1, block_size=64, min_8bit_size=256),
    "adamw8bit": lambda: pf.adamw8bit(1e-2, weight_decay=0.1, block_size=64, min_8bit_size=256),
    "adamw": lambda: pf.adamw(1e-2, weight_decay=0.1),
}


def run(model, rel, data):
    for ids in data:
        loss_of(model, ids).backward()
        assert all(p.grad is None for p in model.parameters())
    return rel


def assert_same(a, b, ra, rb):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    da, db = ra.state_dict("cpu"), rb.state_dict("cpu")
    assert sorted(da) == sorted(db)
    for k in da:
        assert da[k].dtype == db[k].dtype and torch.equal(da[k], db[k]), k


def host_storages(rel):
    return {h.untyped_storage().data_ptr() for h in rel.stager.host.values()}


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("slots", [1, 2, 3, None])
def test_equals_on_device_release(name, slots):
    data = batches(4)
    a, b = tiny_model(), tiny_model()
    ref = run(a, GradientRelease(CHAINS[name](), a), data)
    rel = run(b, OffloadedRelease(CHAINS[name](), b, slots=slots), data)
    assert_same(a, b, ref, rel)
    assert rel.counts() == {4} and rel.steps == 4
    assert rel.metrics().lr == ref.metrics().lr and rel.grad_norm() == ref.grad_norm()
    # between steps every travelling leaf is a view of its group's host buffer, not of a slot
    homes = host_storages(rel)
    slot_storages = {s.buf.untyped_storage().data_ptr() for s in rel.stager.slots}
    for g, state in rel.states.items():
        for x in T.leaves(state):
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                assert x.untyped_storage().data_ptr() in homes and x.untyped_storage().data_ptr() not in slot_storages
    st = rel.offload_stats()
    assert st["d2h_bytes"] == 4 * st["pcie_bytes_per_step"] // 2
    sizes = sorted((lay.nbytes for lay in rel.stager.layouts.values()), reverse=True)
    if slots is None:  # the release's own count
        slots = auto_slots(sizes)
        assert len(rel.stager.slots) == slots
    assert st["staging_bytes"] == slots * slot_size(sizes, slots)
    if slots > 1:  # the two layers' states are the largest, each over a slot: each step takes every slot
        assert sizes[0] > slot_size(sizes, slots) >= sizes[2]
    assert st["host_state_bytes"] >= pf.state_bytes(ref.states) - 8 * 64 * len(ref.states)


def test_auto_slots_size_the_slots_by_the_regular_groups():
    """``auto_slots``: enough slots that the largest group's share is no larger than the
    third-largest group (a decoder layer), so the slots together stay about the largest group
    while more regular groups are in flight; 2 to 16."""
    embed, layer = 389_000_000, 100_000_000  # Qwen3-4B's tied embedding and a decoder layer (8-bit state)
    n = auto_slots([embed] + [layer] * 36)
    assert n == 4 and slot_size([embed] + [layer] * 36, n) == -(-layer // 64) * 64
    assert n * slot_size([embed] + [layer] * 36, n) <= 2 * slot_size([embed] + [layer] * 36, 2) * 1.05
    assert auto_slots([622, 622] + [193] * 36) == 4  # an untied head and embedding (8B)
    assert auto_slots([10, 10, 10]) == 2 and auto_slots([5, 1]) == 2 and auto_slots([]) == 2
    assert auto_slots([10_000, 10, 1]) == 16 and auto_slots([10_000, 10, 1], most=5) == 5


def test_order_is_learned():
    """After the first backward the groups are fetched in the order backward completes them:
    no fetch on demand, one fetch per group per step (plus the next step's first ones)."""
    data = batches(3)
    m = tiny_model(layers=3)
    rel = OffloadedRelease(CHAINS["lion8bit"](), m, groups="parameter")
    rel._set_order(list(rel.groups))  # a wrong first guess (forward order): groups arrive unannounced
    run(m, rel, data[:1])
    first = rel.stager.unannounced
    assert first > 0
    assert rel.step_extras["offload/unannounced"] == first  # what the step record logs
    before = rel.stager.fetches
    run(m, rel, data[1:])
    assert rel.stager.unannounced == first
    n = len(rel.groups)
    assert rel.stager.fetches - before == 2 * n  # the first two were fetched at the end of step 1
    extras = rel.step_extras  # the last step's own
    assert extras["offload/fetches"] == n and extras["offload/unannounced"] == 0
    assert 0 < extras["offload/host_ms"] < extras["release/host_ms"]  # the stager's share of the group steps


def test_resume_is_exact(tmp_path):
    """state_dict of an offloaded release loads into a fresh one (and into an on-device one):
    the run continues exactly as without the interruption."""
    from safetensors.torch import load_file, save_file

    data, chain, a, straight, first, restart = _interrupted()
    save_file(first.state_dict("cpu"), tmp_path / "opt.safetensors")
    for cls in (OffloadedRelease, GradientRelease):
        c = restart()
        rel = cls(chain(), c)
        rel.load_state_dict(load_file(tmp_path / "opt.safetensors"))
        run(c, rel, data[2:])
        assert_same(a, c, straight, rel)


def _interrupted():
    """An offloaded AdamW8bit run of 4 steps straight, and the same run's first 2 steps:
    (data, chain, the straight model, its release, the 2-step release, a function making a
    fresh model with the 2-step weights)."""
    data = batches(4)
    chain = CHAINS["adamw8bit"]
    a = tiny_model()
    straight = run(a, OffloadedRelease(chain(), a), data)
    b = tiny_model()
    first = run(b, OffloadedRelease(chain(), b), data[:2])
    weights = {n: p.detach().clone() for n, p in b.named_parameters()}

    def restart():
        c = tiny_model()
        with torch.no_grad():
            for n, p in c.named_parameters():
                p.copy_(weights[n])
        return c

    return data, chain, a, straight, first, restart


def test_resume_from_a_lazy_file_holds_one_group_at_a_time(tmp_path):
    """A resume reads the offloaded state group by group from the lazily read optimizer file
    (``Checkpoint.optimizer``): at most one group's entries (and the layout fingerprint) alive
    at once, and the run continues exactly; an entry the optimizer lacks is named."""
    from pgs.errors import TreeMismatch
    from pgs.runtime.store import safetensors_io

    data, chain, a, straight, first, restart = _interrupted()
    safetensors_io.write(tmp_path / "opt.safetensors", first.state_dict(copy=False))

    lazy = safetensors_io.read(tmp_path / "opt.safetensors")
    c = restart()
    rel = OffloadedRelease(chain(), c)
    reader = CountingReader(lazy)
    rel.load_state_dict(reader)
    largest = max(len([x for x in T.leaves(st) if x is not None]) for st in rel.states.values())
    # the 0-d leaves read stay: they are the state (on the device); the rest is one group's at most
    kept = sum(1 for st in rel.states.values() for x in T.leaves(st) if x is not None and x.ndim == 0)
    assert reader.most <= largest + kept + 1 < len(lazy)
    run(c, rel, data[2:])
    assert_same(a, c, straight, rel)

    extra = dict(first.state_dict("cpu"), **{"zz.unknown": torch.zeros(2)})
    safetensors_io.write(tmp_path / "extra.safetensors", extra)
    d = tiny_model()
    with pytest.raises(TreeMismatch, match="zz.unknown"):
        OffloadedRelease(chain(), d).load_state_dict(safetensors_io.read(tmp_path / "extra.safetensors"))


def test_tied_slabs_offloaded():
    """The 4B recipe's path: the tied embedding stepped in row slabs at the end of backward,
    with the deferred head gradient, from a staged state."""
    data = batches(3)
    a, b = tiny_model(), tiny_model()
    ref = GradientRelease(CHAINS["lion8bit"](), a, memory=pf.MemoryOptions(tied_slabs=10))
    rel = OffloadedRelease(CHAINS["lion8bit"](), b, memory=pf.MemoryOptions(tied_slabs=10))
    for ids in data:
        slab_step(a, ids, ref)
        slab_step(b, ids, rel)
    assert_same(a, b, ref, rel)


def big_vocab_model():
    """A tiny Qwen3 whose tied embedding's state is larger than a layer's (a group larger than a slot)."""
    return build_tiny(seed=0, num_hidden_layers=4, vocab_size=1024, tie_word_embeddings=True, use_cache=False,
                      attn_implementation="sdpa")


def test_slabs_wait_only_for_the_shares_holding_their_rows():
    """The tied embedding stepped in row slabs from a state larger than a slot: the step does not
    wait for the whole fetch; each slab waits for the shares that hold its rows (the scales sit
    in the first share), so the first slab never waits for the last share.  Equal to the
    on-device release."""
    data = batches(3)
    a, b = big_vocab_model(), big_vocab_model()
    ref = GradientRelease(CHAINS["lion8bit"](), a, memory=pf.MemoryOptions(tied_slabs=256))
    rel = OffloadedRelease(CHAINS["lion8bit"](), b, memory=pf.MemoryOptions(tied_slabs=256))
    st, embed = rel.stager, "model.embed_tokens.weight"
    assert st._big(embed) and len(st.slots) >= 3
    lay = st.layouts[embed]
    assert [nb for _, _, nb, _, _ in lay.entries] == sorted(nb for _, _, nb, _, _ in lay.entries)  # scales first
    waits = []  # (group, indices of the slots of one wait)
    real = st._wait
    st._wait = lambda g, slots: waits.append((g, sorted(s.index for s in slots))) or real(g, slots)
    queued = []  # at the embedding's step: the order its shares were queued in, by slot index
    acquire = st.acquire
    st.acquire = lambda g, **kw: (g == embed and queued.append([s.seq for s in st.slots])) or acquire(g, **kw)
    for ids in data:
        waits.clear()
        slab_step(a, ids, ref)
        slab_step(b, ids, rel)
        mine = [w for g, w in waits if g == embed]
        assert len(mine) == 1024 // 256 + 1  # one per slab, then the write-back's (all of them)
        last = max(s.index for s in st.slots if st.layouts[embed].nbytes > s.index * st.slot_bytes)
        assert last not in mine[0]  # slab 0: its rows and the scales, not the last share
        assert last in mine[-2] and mine[-1] == sorted(s.index for s in st.slots)
    # once the order is learned the slots go round so that the embedding's shares are queued in
    # the order of its bytes: share 0 (the scales, slab 0's rows) first, the last share last
    assert all(seqs == sorted(seqs) for seqs in queued[1:]), queued
    assert_same(a, b, ref, rel)


def test_covering_maps_views_to_their_slots():
    big = {"codes": torch.zeros(40, 8, dtype=torch.uint8), "absmax": torch.ones(5)}
    small = {"codes": torch.zeros(100, dtype=torch.uint8)}
    states = {"e": big, "l": small, "k": small}
    st = StateStager(states, states.items(), slots=3)
    assert st._big("e") and st.slot_bytes == 128
    dev = st.acquire("e")  # absmax at 0 (20 B, padded to 64), codes' 320 B from 64 on
    idx = lambda ts: [s.index for s in st.covering("e", ts)]  # noqa: E731
    assert idx([dev["absmax"]]) == [0]
    assert idx([dev["codes"][:8]]) == [0]  # bytes 64-127
    assert idx([dev["codes"][8:9]]) == [1] and idx([dev["codes"][23:24]]) == [1]  # bytes 128-135, 248-255
    assert idx([dev["codes"][24:25]]) == [2]  # bytes 256-263
    assert idx([dev["codes"][7:9]]) == [0, 1]
    assert idx([dev["codes"]]) == [0, 1, 2] and idx([torch.ones(3), dev["absmax"]]) == [0]
    st.release("e", dev)


def test_big_embedding_last_in_backward_is_announced_and_exact():
    """The 4B recipe's shape in small: the tied embedding, the last group backward completes,
    is larger than a slot.  Its shares are fetched while the last layers step, so once the
    order is learned no group is fetched on demand; the weights and state equal the on-device
    release's."""
    data = batches(4)
    a, b = big_vocab_model(), big_vocab_model()
    ref = GradientRelease(CHAINS["adamw8bit"](), a)
    rel = OffloadedRelease(CHAINS["adamw8bit"](), b)
    embed = "model.embed_tokens.weight"
    assert rel.stager._big(embed) and len(rel.stager.slots) >= 3
    seen = []  # at each acquire: the group, and how many slots hold a share of the embedding
    acquire = rel.stager.acquire
    rel.stager.acquire = lambda g, **kw: seen.append((g, len(rel.stager._slots_of(embed)))) or acquire(g, **kw)
    unannounced = []
    for ids in data:
        loss_of(a, ids).backward()
        loss_of(b, ids).backward()
        unannounced.append(rel.step_extras["offload/unannounced"])
    assert rel._order[-1] == embed
    assert unannounced[1:] == [0, 0, 0]
    last_layer = rel._order[-2]
    held = [n for g, n in seen[len(rel.groups):] if g == last_layer]  # steps 2-4
    assert len(held) == 3 and all(n >= 1 for n in held)  # shares in flight before the last layer steps
    assert_same(a, b, ref, rel)


def test_stager_copies_through_a_slot():
    """The staging class alone: acquire hands out views of a slot (not the host buffer), a step
    writing in place or returning new tensors is written back, 0-d leaves stay put."""
    x = {"m": torch.arange(10.0), "codes": torch.arange(7, dtype=torch.uint8), "count": torch.tensor(3)}
    y = {"m": torch.ones(3), "codes": torch.zeros(130, dtype=torch.uint8), "count": torch.tensor(3)}
    st = StateStager({"a": x, "b": y}, {"a": x, "b": y}.items(), slots=1)
    home = st.home("a")
    assert home["count"] is x["count"] and torch.equal(home["m"], x["m"])
    dev = st.acquire("a")
    assert dev["m"].untyped_storage().data_ptr() == st.slots[0].buf.untyped_storage().data_ptr()
    assert dev["m"].data_ptr() % 64 == 0 and dev["codes"].data_ptr() % 64 == 0
    dev["m"].mul_(2)  # in place, as the fused kernels do
    new = {"m": dev["m"], "codes": dev["codes"] + 1, "count": dev["count"] + 1}  # new tensors, as the plain path
    home = st.release("a", new)
    assert torch.equal(home["m"], 2 * torch.arange(10.0)) and torch.equal(home["codes"], x["codes"] + 1)
    assert int(home["count"]) == 4
    assert st.h2d_bytes == st.d2h_bytes == st.layouts["a"].nbytes
    assert st.slot_bytes == 256  # "b": 3 fp32 (padded to 64) + 130 codes (padded to 192)
    with pytest.raises(Exception, match="another structure"):
        st.acquire("b")
        st.release("b", {"m": y["m"]})


def test_stager_big_group_waits_for_the_busy_slot():
    """A group larger than a slot takes both: the free slot is filled at once, the one whose
    group is stepping is reserved and filled when that group is written back."""
    a, b, c = {"m": torch.arange(40.0)}, {"m": torch.arange(16.0)}, {"m": -torch.arange(16.0)}
    states = {"a": a, "b": b, "c": c}
    st = StateStager(states, states.items(), slots=2)
    assert st.slot_bytes == 128 and st._big("a") and not st._big("b")  # 160 B (192 padded) over 2 slots
    db = st.acquire("b")
    st.prefetch("a")
    held = {s.index: (s.group, s.reserved) for s in st.slots}
    busy = next(s.index for s in st.slots if s.active)
    assert held[busy] == ("b", "a") and held[1 - busy] == ("a", None)
    st.prefetch("c")  # no room: nothing happens
    assert not st._slots_of("c")
    st.release("b", {"m": db["m"] + 1})
    assert all(s.group == "a" and s.reserved is None for s in st.slots)
    da = st.acquire("a")
    assert torch.equal(da["m"], torch.arange(40.0)) and st.unannounced == 1
    st.release("a", {"m": da["m"] * 2})
    assert torch.equal(st.home("a")["m"], 2 * torch.arange(40.0))
    assert torch.equal(st.home("b")["m"], torch.arange(16.0) + 1)
    dc = st.acquire("c")  # unannounced: fetched on demand
    assert torch.equal(dc["m"], -torch.arange(16.0)) and st.unannounced == 2


def test_stager_big_group_shares_follow_the_groups_before_it():
    """A big group named while regular groups still wait for their steps takes the free slot at
    once and reserves the others: each share is copied as the group in its slot is written back
    (the waiting groups keep their slots and step from them), so the big group is whole, and
    announced, when its turn comes."""
    big = {"m": torch.arange(90.0)}
    regs = {g: {"m": torch.full((16,), float(i))} for i, g in enumerate("bcd")}
    states = {"a": big, **regs}
    st = StateStager(states, states.items(), slots=3)
    assert st._big("a") and not any(st._big(g) for g in "bcd")
    db = st.acquire("b")  # on demand (the first group of a step)
    st.prefetch("c")
    st.prefetch("a")
    slot = {s.group: s for s in st.slots}
    assert slot["b"].reserved == "a" and slot["c"].reserved == "a" and "a" in slot  # the free one is a's now
    st.prefetch("d")  # no room for a regular group behind the big one's shares
    assert not st._slots_of("d")
    st.release("b", {"m": db["m"] + 1})
    assert slot["b"].group == "a" and slot["b"].reserved is None
    dc = st.acquire("c")  # announced: c kept its slot
    assert torch.equal(dc["m"], torch.full((16,), 1.0))
    st.release("c", {"m": dc["m"] * 3})
    assert all(s.group == "a" and s.reserved is None for s in st.slots)
    da = st.acquire("a")
    assert torch.equal(da["m"], torch.arange(90.0)) and st.unannounced == 1  # only b's
    st.release("a", {"m": da["m"] - 1})
    assert torch.equal(st.home("a")["m"], torch.arange(90.0) - 1)
    assert torch.equal(st.home("b")["m"], torch.zeros(16) + 1) and torch.equal(st.home("c")["m"], torch.full((16,), 3.0))


def test_stager_big_group_whose_predecessor_never_steps_is_fetched_on_demand():
    """The order was wrong: a group holding one of the big group's reserved slots never steps.
    The big group's step fetches it whole (unannounced), evicting the stale group; a regular
    group arriving unannounced while the big one's shares are reserved takes a slot too."""
    big = {"m": torch.arange(90.0)}
    regs = {g: {"m": torch.full((16,), float(i))} for i, g in enumerate("bcd")}
    states = {"a": big, **regs}
    st = StateStager(states, states.items(), slots=3)
    db = st.acquire("b")
    st.prefetch("c")
    st.prefetch("a")
    st.release("b", {"m": db["m"] + 1})  # c never steps: its slot stays reserved for a
    da = st.acquire("a")
    assert st.unannounced == 2 and torch.equal(da["m"], torch.arange(90.0))
    st.release("a", {"m": da["m"] * 2})
    dc = st.acquire("c")  # evicted by a's fetch: on demand, its home intact
    assert torch.equal(dc["m"], torch.full((16,), 1.0)) and st.unannounced == 3
    st.release("c", {"m": dc["m"]})
    st.prefetch("c")
    st.prefetch("a")  # c waits in one slot: a takes the two free ones, reserves c's
    dd = st.acquire("d")  # unannounced, every free slot a's or reserved: a's shares give way
    assert torch.equal(dd["m"], torch.full((16,), 2.0)) and st.unannounced == 4
    st.release("d", {"m": dd["m"] + 5})
    assert not any(s.reserved == "a" for s in st.slots)
    da = st.acquire("a")
    assert torch.equal(da["m"], 2 * torch.arange(90.0))
    st.release("a", {"m": da["m"]})
    assert torch.equal(st.home("d")["m"], torch.full((16,), 7.0))


def _memory(**kw):
    return attrs.evolve(MemorySpec(), **kw)


def test_refusals():
    m = tiny_model()
    with pytest.raises(SpecError, match="offload_optimizer.*gradient_release = true"):
        make_optimizer(CHAINS["lion8bit"](), m, _memory(offload_optimizer=True))
    # several processes: the sharded offloaded release (it needs the FSDP2-sharded model; the runs
    # are tests/integration/test_fsdp_offload.py's); tied slabs are refused there, with the reason
    with pytest.raises(InvalidArgument, match="ShardedGradientRelease: the model is not sharded"):
        make_optimizer(CHAINS["lion8bit"](), m, _memory(offload_optimizer=True, gradient_release=True), sharded=True)
    assert single_process_refusal(_memory(offload_optimizer=True, gradient_release=True)) is None
    why = single_process_refusal(_memory(tied_slabs=8, gradient_release=True))
    assert why.startswith("memory.tied_slabs: with several processes FSDP2 reduce-scatters the embedding's whole")
    rel = make_optimizer(CHAINS["lion8bit"](), m, _memory(offload_optimizer=True, gradient_release=True))
    assert type(rel) is OffloadedRelease and isinstance(rel, Optimizer) and rel.in_backward
    assert isinstance(rel.metrics(), StepMetrics) and rel.state_bytes() > 0


def test_spec_switch(tmp_path):
    from pgs.runtime.spec.load import load_spec

    base = (tmp_path / "s.toml")
    base.write_text('[model]\nconfig = { model_type = "qwen3", hidden_size = 32, intermediate_size = 64, '
                    'num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8 }\n'
                    'tokenizer = "pgs:quickstart/tokenizer"\n'
                    '[data]\nsources = [{ path = "pgs:bench/chats.jsonl" }]\n[train]\nsteps = 2\n'
                    '[optimizer]\nalias = "lion8bit"\nclip = 0.0\n'
                    '[memory]\noffload_optimizer = true\n')
    with pytest.raises(SpecError, match="memory.offload_optimizer"):
        load_spec(base)


# -- CUDA: the side streams, events and pinned memory, the fused 8-bit kernels -----------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def distinct_batches(n, seed=1):
    """``batches``' shape with no token twice in a step: the embedding's backward then adds no two
    rows into one (a CUDA index_add_ with collisions sums in an order that can vary run to run)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(VOCAB, generator=g)[:24].view(2, 12) for _ in range(n)]


@pytest.fixture
def math_attention():
    """Attention through the math backend: the two models' backward passes are then the same
    kernels with no atomics (flash / memory-efficient attention's dQ accumulation may differ in
    the last bit between two runs), so any difference is the offload's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def alone(name: str) -> str:
    """A release grouping: every parameter in a group of its own (small ones too)."""
    return name


def _disturb(seed: int) -> None:
    """Reseed torch's global generators and draw from them, as other code between runs would."""
    torch.manual_seed(seed)
    torch.rand(1000)
    if torch.cuda.is_available():
        torch.rand(1000, device="cuda")


def three_runs_bf16(device, make, *, slots, steps, layers, groups="layer"):
    """The bf16 tiny model with stochastic rounding, trained three times one after another:
    the on-device release twice (is the reference reproducible here?) and the offloaded one,
    the global generators reseeded and drawn from before each.  The fused 8-bit steps draw
    every rounding from the state's seed (the step count and the tensor's index), never from
    those generators, so the three must be equal bit for bit.  ``groups``: the releases'
    grouping; with ``alone`` (every parameter its own group) the tied embedding is the one
    group larger than a slot, which takes every slot (with layer groups the decoder layers are
    the largest groups: larger than a slot with 2 layers, none is with 4)."""
    device = torch.device(device)
    data = [ids.to(device) for ids in distinct_batches(steps)]
    runs = {}
    for i, (label, cls, kw) in enumerate((("ref", GradientRelease, {}), ("ref2", GradientRelease, {}),
                                          ("offload", OffloadedRelease, {"slots": slots}))):
        m = tiny_model(torch.bfloat16, layers=layers).to(device)
        rel = cls(make(), m, memory=pf.MemoryOptions(stochastic_rounding=True), groups=groups, **kw)
        _disturb(1000 + i)
        run(m, rel, data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs[label] = (m, rel)
    return runs


def assert_three_same(runs) -> None:
    (a, ra), (a2, ra2), (b, rb) = runs["ref"], runs["ref2"], runs["offload"]
    assert_same(a, a2, ra, ra2)  # the reference is reproducible (else a difference below is not the offload's)
    assert_same(a, b, ra, rb)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["lion8bit", "adamw8bit"])
@pytest.mark.parametrize("slots", [2, None])
@pytest.mark.parametrize("groups", ["layer", "alone"])
def test_cuda_fused_bf16_equals_on_device(name, slots, groups, math_attention):
    """bf16 weights with stochastic rounding and the fused 8-bit kernels, on a GPU: the state
    streamed through pinned memory and side streams gives the same bits as the state kept on
    the device (the compute stream waits for each fetch, each fetch for the slot's and the
    group's last write-back).  ``alone``: the tied embedding is a group larger than a slot (the
    fetch over every slot)."""
    runs = three_runs_bf16("cuda", CHAINS[name], slots=slots, steps=5, layers=4,
                           groups=alone if groups == "alone" else groups)
    if groups == "alone":
        st = runs["offload"][1].stager
        assert [g for g in st.layouts if st._big(g)] == ["model.embed_tokens.weight"]
    rel, ref = runs["offload"][1], runs["ref"][1]
    assert rel.stager.page_locked  # registered with cudaHostRegister (or the pinned allocator's)
    assert rel.fused_group_steps == ref.fused_group_steps > 0
    assert_three_same(runs)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("groups", ["layer", "alone"])
def test_fused_adamw8bit_bf16_equals_on_device_interpreted(groups):
    """The CUDA test's comparison on the CPU: the fused 8-bit kernels in Triton's interpreter
    (``backend="triton"``), bf16 with stochastic rounding (AdamW8bit's small leaves through the
    seeded rounding kernel), the tied embedding.  The groups larger than a slot: the two
    decoder layers (``"layer"``), the embedding (``alone``)."""
    make = lambda: pf.adamw8bit(1e-2, weight_decay=0.1, block_size=64, min_8bit_size=256, backend="triton")  # noqa: E731
    runs = three_runs_bf16("cpu", make, slots=2, steps=3, layers=2, groups=alone if groups == "alone" else groups)
    rel = runs["offload"][1]
    big = [g for g in rel.stager.layouts if rel.stager._big(g)]
    assert big == (["model.embed_tokens.weight"] if groups == "alone" else ["model.layers.0", "model.layers.1"])
    assert rel.fused_group_steps == runs["ref"][1].fused_group_steps == 3 * len(rel.groups)
    assert rel.plain_group_steps == 0
    assert_three_same(runs)


def test_adamw8bit_small_leaves_ignore_the_global_generator():
    """With stochastic rounding AdamW8bit's fused step rounds its small (fp32-state) leaves from
    the state's seed: two identical runs stepped one after the other on one generator, and a
    third from a reseeded generator, give the same parameters (the small leaves included: each
    moved, by a step whose fraction of an ulp the rounding decides)."""
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    make = lambda: pf.adamw8bit(1e-2, weight_decay=0.1, block_size=64, min_8bit_size=256, backend="triton")  # noqa: E731
    ids = distinct_batches(1)[0].to(dev)
    start = tiny_model(torch.bfloat16, layers=1)
    out = []
    for i in range(3):
        m = tiny_model(torch.bfloat16, layers=1).to(dev)
        rel = GradientRelease(make(), m, memory=pf.MemoryOptions(stochastic_rounding=True))
        if i == 2:
            _disturb(7)
        loss_of(m, ids).backward()
        assert rel.fused_group_steps == len(rel.groups)
        out.append({n: p.detach().cpu() for n, p in m.named_parameters()})
    small = [n for n, p in out[0].items() if p.numel() < 256]
    assert small and all(not torch.equal(out[0][n], p) for n, p in start.named_parameters() if n in small)
    for other in out[1:]:
        differ = [n for n, p in out[0].items() if not torch.equal(p, other[n])]
        assert not differ, differ


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("slow", ["compute", "h2d", "d2h"])
def test_cuda_a_slow_stream_does_not_race(slow, math_attention):
    """Long kernels queued on one stream before each backward — the compute stream (steps late:
    the write-backs must wait for them), the fetch stream (copies late: the steps must wait for
    them) or the write-back stream (slots freed late: the next fetch into a slot must wait) —
    and the result still equals the on-device release bit for bit."""
    data = [ids.cuda() for ids in distinct_batches(4)]
    a, b = tiny_model(layers=3).cuda(), tiny_model(layers=3).cuda()
    ref = GradientRelease(CHAINS["adamw8bit"](), a)
    rel = OffloadedRelease(CHAINS["adamw8bit"](), b, slots=2)
    stream = {"compute": torch.cuda.current_stream(), "h2d": rel.stager.h2d, "d2h": rel.stager.d2h}[slow]
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for ids in data:
        loss_of(a, ids).backward()
        with torch.cuda.stream(stream):
            for _ in range(20):
                big = torch.tanh(big @ big / 64)
        loss_of(b, ids).backward()
    rel.state_dict()  # synchronizes with the copies
    torch.cuda.synchronize()
    assert_same(a, b, ref, rel)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("slow", ["compute", "h2d", "d2h"])
def test_cuda_slabs_waiting_share_by_share_do_not_race(slow, math_attention):
    """The tied embedding, larger than a slot, stepped in row slabs that each wait only for the
    shares holding their rows (``StateStager.wait_for``), with one stream delayed in turn: equal
    to the on-device release bit for bit."""
    data = [ids.cuda() for ids in distinct_batches(4)]
    a, b = big_vocab_model().cuda(), big_vocab_model().cuda()
    ref = GradientRelease(CHAINS["lion8bit"](), a, memory=pf.MemoryOptions(tied_slabs=256))
    rel = OffloadedRelease(CHAINS["lion8bit"](), b, memory=pf.MemoryOptions(tied_slabs=256))
    assert rel.stager._big("model.embed_tokens.weight")
    stream = {"compute": torch.cuda.current_stream(), "h2d": rel.stager.h2d, "d2h": rel.stager.d2h}[slow]
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for ids in data:
        slab_step(a, ids, ref)
        with torch.cuda.stream(stream):
            for _ in range(20):
                big = torch.tanh(big @ big / 64)
        slab_step(b, ids, rel)
    rel.state_dict()
    torch.cuda.synchronize()
    assert_same(a, b, ref, rel)


@pytest.mark.cuda
@cuda
def test_cuda_tied_slabs_and_resume(tmp_path, math_attention):
    from safetensors.torch import load_file, save_file

    data = [ids.cuda() for ids in distinct_batches(4)]
    a, b = tiny_model(torch.bfloat16).cuda(), tiny_model(torch.bfloat16).cuda()
    ref = GradientRelease(CHAINS["lion8bit"](), a, memory=pf.MemoryOptions(tied_slabs=10, stochastic_rounding=True))
    rel = OffloadedRelease(CHAINS["lion8bit"](), b, memory=pf.MemoryOptions(tied_slabs=10, stochastic_rounding=True))
    for ids in data[:2]:
        slab_step(a, ids, ref)
        slab_step(b, ids, rel)
    save_file(rel.state_dict("cpu"), tmp_path / "o.safetensors")
    rel.remove()
    rel2 = OffloadedRelease(CHAINS["lion8bit"](), b, memory=pf.MemoryOptions(tied_slabs=10, stochastic_rounding=True))
    rel2.load_state_dict(load_file(tmp_path / "o.safetensors"))
    for ids in data[2:]:
        slab_step(a, ids, ref)
        slab_step(b, ids, rel2)
    assert_same(a, b, ref, rel2)


@pytest.mark.parametrize("name", ["lion8bit", "adamw"])
def test_profile_prediction_exact(name):
    """``predict_memory(..., offload_optimizer=True)``: the device's state is the staging slots,
    the host's and the PCIe bytes what the real release holds and moves."""
    from pgs.runtime.tools.profile import predict_memory

    m = tiny_model(layers=3)
    rel = OffloadedRelease(CHAINS[name](), m)
    pred = predict_memory(m.config, dtype=torch.float32, chain=CHAINS[name](), gradient_release=True,
                          offload_optimizer=True, micro_batch_tokens=24)
    assert pred["optimizer_state"] == rel.offload_stats()["staging_bytes"]
    assert pred["host_state"] == rel.offload_stats()["host_state_bytes"]
    assert pred["pcie_per_step"] == rel.offload_stats()["pcie_bytes_per_step"]
    on_device = predict_memory(m.config, dtype=torch.float32, chain=CHAINS[name](), gradient_release=True,
                               micro_batch_tokens=24)
    assert on_device["optimizer_state"] > pred["optimizer_state"] and "host_state" not in on_device
    # a checkpoint holds the whole state either way (the disk check and the background snapshot)
    from pgs.runtime.tools.profile import checkpoint_bytes

    assert checkpoint_bytes(pred) == pred["weights"] + rel.offload_stats()["host_state_bytes"]


@pytest.mark.slow
def test_pgs_run_offloaded_sigkill_resume_equals_on_device_run(tmp_path, capfd):
    """Through ``pgs run``: the offloaded run, killed after step 4 and resumed from its step-3
    checkpoint, ends with the weights and optimizer file of the on-device release run."""
    import signal

    from pgs.runtime.loop.faults import Faults
    from helpers import assert_same_checkpoint, launch, run_here
    from test_train_release import release_spec

    assert run_here(release_spec(tmp_path, "ref")) == 0  # in this process, one thread (as the children)
    spec = release_spec(tmp_path, "run")
    spec.write_text(spec.read_text() + "offload_optimizer = true\n")
    first = launch(spec, **Faults(crash_at=("step", 5)).env())
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert "optimizer state in host memory" in first.stdout + first.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "event" not in r]
    assert steps and all(r["offload/fetches"] > 0 for r in steps)
    assert steps[-1]["offload/unannounced"] == 0  # the order learned in step 1 holds
    assert all(0 < r["offload/host_ms"] < r["release/host_ms"] for r in steps)
    capfd.readouterr()
    assert run_here(spec, "--resume", "auto") == 0
    assert "step_3" in capfd.readouterr().err
    assert_same_checkpoint(tmp_path / "run" / "step_6", tmp_path / "ref" / "step_6")  # weights and optimizer bits


@pytest.mark.parametrize("cls", [OffloadedRelease, GradientRelease])
def test_state_views_write_the_same_file(tmp_path, cls):
    """``state_dict(copy=False)`` (views of the host buffer, for the checkpoint's streaming
    writer) writes the file that ``save_file`` writes from the copying ``state_dict("cpu")``."""
    from safetensors.torch import save_file

    from pgs.runtime.store import safetensors_io

    m = tiny_model()
    rel = run(m, cls(CHAINS["adamw8bit"](), m), batches(2))
    views = rel.state_dict(copy=False)
    save_file(rel.state_dict("cpu"), tmp_path / "ref.safetensors", metadata={"pgs": "optimizer"})
    safetensors_io.write(tmp_path / "ours.safetensors", views, {"pgs": "optimizer"}, chunk_bytes=1000)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    if cls is OffloadedRelease:  # no copies: the travelling leaves are views of the pinned host buffer
        whole = rel.stager._whole.untyped_storage().data_ptr()
        assert any(v.untyped_storage().data_ptr() == whole for v in views.values())


def test_nproc_of_validate_and_profile(tmp_path, capsys, monkeypatch):
    """``pgs validate --nproc 2`` refuses what ``pgs run --nproc 2`` refuses (tied slabs, with the
    reason), one line and exit 2; ``pgs profile --measure`` measures one process, so ``--nproc 2``
    beside it is refused; the estimate for 2 processes prints the host state per process."""
    from helpers import cli_error, tiny_spec

    monkeypatch.delenv("COLUMNS", raising=False)  # the pipe's width (output.PIPE_WIDTH): no row wraps

    spec = tiny_spec(tmp_path, "s", steps=4)
    text = spec.read_text().replace("grad_accum = 2", "grad_accum = 1").replace('alias = "adamw"',
                                                                                'alias = "adamw"\nclip = 0')
    spec.write_text(text + "\n[memory]\ngradient_release = true\ntied_slabs = 8\n")
    code, line = cli_error(["validate", str(spec), "--nproc", "2"], capsys)
    assert code == 2 and "memory.tied_slabs: with several processes FSDP2 reduce-scatters" in line
    code, line = cli_error(["profile", str(spec), "--measure", "--nproc", "2"], capsys)
    assert code == 2 and "--measure runs the step on one process; drop --nproc 2" in line
    spec.write_text(text + "\n[memory]\ngradient_release = true\noffload_optimizer = true\n")
    from pgs.cli import main

    assert main(["profile", str(spec), "--nproc", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the console wraps the title)
    assert "one of 2 processes" in out and "offload_optimizer, per process of 2" in out
