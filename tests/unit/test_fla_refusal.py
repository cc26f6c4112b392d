"""flash-linear-attention's refusal of its gated backward on Hopper with Triton 3.4-3.7.0 is asked
before a hybrid model trains (``pgs.runtime.model.linear_attention.backward_refusal``): a stand-in
fla package states the conditions fla itself reads, so the rule is checked without a GPU."""

import sys
import types

import pytest
import torch

from pgs.runtime.model import linear_attention as LA


def fake_fla(monkeypatch, hopper: bool, triton_ok: bool, tilelang: bool):
    utils = types.ModuleType("fla.utils")
    utils.IS_NVIDIA_HOPPER, utils.TRITON_ABOVE_3_4_0, utils.TRITON_ABOVE_3_7_1 = hopper, True, triton_ok
    backends = types.ModuleType("fla.backends")
    backends.TileLangBackend = type("TileLangBackend", (), {"is_available": classmethod(lambda cls: tilelang)})
    fla = types.ModuleType("fla")
    for name, module in (("fla", fla), ("fla.utils", utils), ("fla.backends", backends)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(LA, "_KERNELS", [(lambda *a: None, lambda *a: None)])  # fla's kernels "found"


@pytest.mark.parametrize("hopper,triton_ok,tilelang,refused", [
    (True, False, False, True),   # the broken combination: refused
    (True, False, True, False),   # TileLang takes the kernel
    (True, True, False, False),   # Triton >= 3.7.1
    (False, False, False, False),  # not a Hopper GPU
])
def test_refusal_follows_fla_rule(monkeypatch, hopper, triton_ok, tilelang, refused):
    fake_fla(monkeypatch, hopper, triton_ok, tilelang)
    line = LA.backward_refusal(torch.device("cuda", 0))
    assert (line is not None) == refused
    if refused:
        assert "tilelang" in line and "3.7.1" in line and "\n" not in line


def test_no_refusal_on_cpu_or_without_fla(monkeypatch):
    fake_fla(monkeypatch, True, False, False)
    assert LA.backward_refusal(torch.device("cpu")) is None
    monkeypatch.setattr(LA, "_KERNELS", [()])  # fla not installed
    assert LA.backward_refusal(torch.device("cuda", 0)) is None
