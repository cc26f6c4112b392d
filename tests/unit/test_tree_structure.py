"""``pgs.func.tree.Structure``: the compiled walks equal torch's pytree flatten and unflatten on
every tree of the structure, refuse trees of another structure, and fall back to torch's walk
for node types they do not know."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pgs.func as pf
from pgs.errors import TreeMismatch
from pgs.func import tree as T

Pair = namedtuple("Pair", "a b")
Empty = namedtuple("Empty", "")


def _trees():
    leaf = st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)) | st.none()
    return st.recursive(leaf, lambda kids: st.one_of(
        st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), kids, max_size=3),
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.tuples(kids, kids).map(lambda t: Pair(*t)),
        st.just(Empty()),
        st.dictionaries(st.sampled_from("pq"), kids, max_size=2).map(OrderedDict),
    ), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(_trees())
def test_build_and_read_equal_torchs_walk(tree):
    leaves, spec = T.flatten(tree)
    s = T.Structure(spec)
    assert len(s.read(tree)) == len(leaves) and all(x is y for x, y in zip(s.read(tree), leaves))
    rebuilt = s.build(leaves)
    again, spec2 = T.flatten(rebuilt)
    assert spec2 == spec and all(x is y for x, y in zip(again, leaves))
    assert type(rebuilt) is type(tree)


def test_chain_state_round_trips():
    state = pf.lion8bit(1e-3, block_size=64, min_8bit_size=256).init({"w": torch.zeros(64, 256), "n": torch.zeros(64)})
    leaves, spec = T.flatten(state)
    s = T.Structure(spec)
    built = s.build(leaves)
    assert T.flatten(built)[1] == spec and type(built["0_scale_by_lion8bit"]) is type(state["0_scale_by_lion8bit"])


@pytest.mark.parametrize("other", [
    {"a": torch.ones(1)},  # a key missing
    {"a": torch.ones(1), "b": [torch.ones(1)], "c": torch.ones(1)},  # a key more
    {"a": torch.ones(1), "b": (torch.ones(1),)},  # a tuple for a list
    {"a": torch.ones(1), "b": [torch.ones(1), torch.ones(1)]},  # a longer list
    {"a": torch.ones(1), "c": [torch.ones(1)]},  # another key
    [torch.ones(1), [torch.ones(1)]],  # a list for the dict
])
def test_read_refuses_another_structure(other):
    s = T.Structure(T.flatten({"a": torch.ones(1), "b": [torch.ones(1)]})[1])
    with pytest.raises(TreeMismatch):
        s.read(other)


def test_build_refuses_a_wrong_leaf_count():
    s = T.Structure(T.flatten({"a": torch.ones(1), "b": [torch.ones(1)]})[1])
    with pytest.raises(TreeMismatch, match="3 leaves for a structure of 2"):
        s.build([torch.ones(1)] * 3)
