"""``memory.offload_optimizer`` with FSDP2 (``pgs.runtime.optim.sharded_offload``) on 2 gloo ranks.

One 2-rank run of tests/integration/fsdp_release_harness.py's ``offload`` scenario (ranks started
as tests/integration/test_fsdp_release.py starts them, bounded by a timeout) checks, for AdamW
(fp32 state, tied head), AdamW8bit (tied) and Lion8bit (untied head), 10 steps each:

- the weights and every state leaf equal the on-device sharded release's bit for bit (the same
  chain on the same values: the staged views are the state), and the weights equal one process
  (``bind``, the harness's single-process reference) bit for bit: the FSDP2 sum of the two
  ranks' gradients is the one process's accumulation (tests/integration/test_fsdp.py), and the
  8-bit blocks of 64 elements are whole rows of every shard, so each shard's blocks are blocks
  of the whole tensor;
- between steps every travelling leaf lives in the rank's host buffer; each rank holds half of
  the one-process host state (up to the 64-byte alignment of each leaf);
- a DCP checkpoint after 5 steps resumed into a fresh offloaded release, and into an on-device
  sharded release (the same keys), ends at the uninterrupted run's weights and state bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from test_fsdp import H, _logs, finish, results
from test_fsdp_release import R, start


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_offload")
    procs = start("offload", out)
    refs, host = {}, {}
    try:  # one process meanwhile: bind's weights, and the one-process offloaded release's host bytes
        from pgs.runtime.optim.offload import OffloadedRelease

        for name, entry in R.OFFLOAD_CHAINS.items():
            saved = H.CHAINS.get(name)
            H.CHAINS[name] = entry
            try:
                refs[name] = H.full_params(H.reference(name, R.STEPS)[0])
            finally:
                if saved is None:
                    del H.CHAINS[name]
                else:
                    H.CHAINS[name] = saved
            host[name] = OffloadedRelease(entry[0](), H.tiny_model(entry[1])).offload_stats()["host_state_bytes"]
    finally:
        codes = finish(procs, out)
    assert codes == [0, 0], _logs(out)
    return out, refs, host, results(out, "offload")


@pytest.mark.parametrize("name", list(R.OFFLOAD_CHAINS))
def test_offloaded_equals_on_device_sharded_release_and_one_process(offloaded, name):
    out, refs, _, ranks = offloaded
    for r in ranks:
        got = r[name]
        assert got["max_abs_diff"] == 0.0 and got["state_equal"], got
        assert got["state_on_host"] and got["grads_left"] == 0
        assert got["release_steps"] == R.STEPS and got["streamed"] == [got["units"]] * R.STEPS
        assert got["unannounced"] == 0  # units complete in the order learned (reverse layers, root last)
        assert got["d2h_bytes"] == R.STEPS * got["pcie_bytes_per_step"] // 2
        assert got["step_extras"]["offload/fetches"] == got["units"]
    weights = torch.load(out / f"offload_{name}.pt")
    assert max((weights[k] - refs[name][k]).abs().max().item() for k in weights) == 0.0
    initial = H.full_params(H.tiny_model(R.OFFLOAD_CHAINS[name][1]))
    assert max((weights[k] - initial[k]).abs().max().item() for k in weights) > 1e-4  # it trained


@pytest.mark.parametrize("name", list(R.OFFLOAD_CHAINS))
def test_each_rank_holds_half_the_host_state(offloaded, name):
    _, _, host, ranks = offloaded
    for r in ranks:
        got = r[name]
        # each travelling leaf is padded to 64 bytes in the host buffer, on one process and on each rank
        assert abs(got["host_state_bytes"] - host[name] / 2) <= 64 * got["host_leaves"], (got, host[name])
        assert got["host_state_bytes"] < 0.53 * host[name]
        assert got["staging_bytes"] < got["host_state_bytes"]


def test_dcp_resume_bit_exact_into_offloaded_and_on_device(offloaded):
    _, _, _, ranks = offloaded
    for r in ranks:
        assert r["per_rank_keys"] > 0  # the 8-bit codes and scales of a shard, saved per rank
        assert r["resume_max_abs_diff"] == 0.0 and r["resume_state_equal"]
        assert r["resume_on_device_max_abs_diff"] == 0.0 and r["resume_on_device_state_equal"]
