"""Bad input gives one clear ``pgs.errors`` exception that names the leaf or the argument.

Checked on both the per-parameter (reference) path and the flat ``pf.compile`` path.
"""

from __future__ import annotations

import math

import pytest
import torch

import pgs.func as pf
from pgs.errors import EXIT_BAD_INPUT, InvalidArgument, PgsError, TreeMismatch


def _params():
    return {"a": torch.randn(3, 4), "b": [torch.randn(()), torch.randn(5)]}


def _grads(**replace):
    g = {"a": torch.randn(3, 4), "b": [torch.randn(()), torch.randn(5)]}
    g.update(replace)
    return g


# name -> (bad grads, the path the message must name)
BAD_GRADS = {
    "wrong_shape": (lambda: _grads(a=torch.randn(4, 3)), "'a'"),
    "missing_leaf": (lambda: _grads(b=[torch.randn(())]), "'b.1'"),
    "extra_leaf": (lambda: _grads(c=torch.randn(2)), "'c'"),
    "renamed_leaf": (lambda: {"z": torch.randn(3, 4), "b": [torch.randn(()), torch.randn(5)]}, "'"),
    "non_tensor_leaf": (lambda: _grads(b=[1.0, torch.randn(5)]), "'b.0'"),
    "broadcastable_shape": (lambda: _grads(b=[torch.randn(()), torch.randn(1)]), "'b.1'"),
}

OPTIMIZERS = {
    "adamw": lambda: pf.adamw(1e-3, weight_decay=0.1),
    "lion": lambda: pf.lion(1e-4, weight_decay=0.1),
    "sgd_momentum": lambda: pf.sgd(1e-2, momentum=0.9),
    "clip_adam_lr": lambda: pf.chain(pf.clip_by_global_norm(1.0), pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3)),
    "partition": lambda: pf.partition(
        {"m": pf.adamw(1e-3), "v": pf.lion(1e-4)}, lambda path, p: "m" if p.ndim >= 2 else "v"
    ),
}


def _path(kind: str, make):
    return make() if kind == "reference" else pf.compile(make(), jit=False)


@pytest.mark.parametrize("kind", ["reference", "compile"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(BAD_GRADS))
def test_bad_grads_name_the_leaf(kind, opt_name, case):
    make_grads, path = BAD_GRADS[case]
    opt = _path(kind, OPTIMIZERS[opt_name])
    params = _params()
    state = opt.init(params)
    with pytest.raises(PgsError) as info:
        opt.update(make_grads(), state, params)
    msg = str(info.value)
    assert path in msg, msg
    if case == "renamed_leaf":
        assert "'a'" in msg or "'z'" in msg, msg
    assert info.value.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize("kind", ["reference", "compile"])
def test_grads_that_do_not_match_the_state(kind):
    """Params and grads agree with each other but not with the state the optimizer was made for."""
    opt = _path(kind, lambda: pf.chain(pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3)))
    state = opt.init(_params())
    other = {"a": torch.randn(3, 4), "b": [torch.randn(()), torch.randn(6)]}
    with pytest.raises(TreeMismatch, match=r"'b\.1'"):
        opt.update(other, state, other)
    with pytest.raises(TreeMismatch, match=r"'b\.1'"):
        opt.update(other, state)


@pytest.mark.parametrize("kind", ["reference", "compile"])
def test_non_tensor_param_names_the_leaf(kind):
    opt = _path(kind, lambda: pf.adamw(1e-3))
    with pytest.raises(PgsError, match=r"'b\.0'.*float"):
        opt.init({"a": torch.randn(2), "b": [3.0]})


def test_apply_updates_names_the_leaf():
    with pytest.raises(TreeMismatch, match=r"'b\.1'"):
        pf.apply_updates(_params(), _grads(b=[torch.randn(()), torch.randn(6)]))


def test_update_without_params_names_the_transform():
    opt = pf.adamw(1e-3, weight_decay=0.1)
    state = opt.init(_params())
    with pytest.raises(InvalidArgument, match="add_decayed_weights.*params"):
        opt.update(_grads(), state)


def test_wrong_chain_state_names_the_keys():
    params = _params()
    state = pf.lion().init(params)
    with pytest.raises(InvalidArgument, match="scale_by_adam"):
        pf.adamw().update(_grads(), state, params)


NAN = math.nan

# (what builds the bad thing, a word the message must contain)
BAD_HYPERPARAMETERS = {
    "adamw_negative_lr": (lambda: pf.adamw(learning_rate=-1e-3), "learning_rate"),
    "adamw_nan_lr": (lambda: pf.adamw(learning_rate=NAN), "learning_rate"),
    "adamw_b1_one": (lambda: pf.adamw(b1=1.0), "b1"),
    "adamw_b1_above_one": (lambda: pf.adamw(b1=1.5), "b1"),
    "adamw_b1_nan": (lambda: pf.adamw(b1=NAN), "b1"),
    "adamw_b2_one": (lambda: pf.adamw(b2=1.0), "b2"),
    "adamw_negative_b1": (lambda: pf.adamw(b1=-0.1), "b1"),
    "adamw_negative_eps": (lambda: pf.adamw(eps=-1e-8), "eps"),
    "adamw_negative_weight_decay": (lambda: pf.adamw(weight_decay=-0.1), "weight_decay"),
    "adamw_nan_weight_decay": (lambda: pf.adamw(weight_decay=NAN), "weight_decay"),
    "adam_string_b1": (lambda: pf.scale_by_adam(b1="0.9"), "b1"),
    "lion_b1_above_one": (lambda: pf.lion(b1=1.5), "b1"),
    "lion_negative_b2": (lambda: pf.lion(b2=-0.5), "b2"),
    "lion_negative_lr": (lambda: pf.lion(learning_rate=-1.0), "learning_rate"),
    "lion_negative_weight_decay": (lambda: pf.lion(weight_decay=-1.0), "weight_decay"),
    "sgd_momentum_one": (lambda: pf.sgd(momentum=1.0), "momentum"),
    "sgd_negative_momentum": (lambda: pf.sgd(momentum=-0.5), "momentum"),
    "sgd_nesterov_without_momentum": (lambda: pf.sgd(nesterov=True), "nesterov"),
    "sgd_negative_lr": (lambda: pf.sgd(learning_rate=-0.1), "learning_rate"),
    "sgd_nan_weight_decay": (lambda: pf.sgd(weight_decay=NAN), "weight_decay"),
    "lr_negative": (lambda: pf.scale_by_learning_rate(-1e-3), "learning_rate"),
    "clip_zero": (lambda: pf.clip_by_global_norm(0.0), "max_norm"),
    "clip_nan": (lambda: pf.clip_by_global_norm(NAN), "max_norm"),
    "clip_per_tensor_negative": (lambda: pf.clip_by_norm_per_tensor(-1.0), "max_norm"),
    "decay_negative": (lambda: pf.add_decayed_weights(-1e-2), "weight_decay"),
    "decay_bad_mask_leaf": (lambda: pf.add_decayed_weights(0.1, mask={"a": "yes"}), "'a'"),
    "accumulate_zero": (lambda: pf.accumulate(pf.adamw(), every=0), "every"),
    "chain_non_transform": (lambda: pf.chain(pf.scale_by_adam(), 0.1), "argument 1"),
    "named_chain_duplicate": (lambda: pf.named_chain(("x", pf.identity()), ("x", pf.identity())), "unique"),
    "partition_not_a_transform": (lambda: pf.partition({"a": 1.0}, lambda p, x: "a"), "transforms['a']"),
    "inject_negative_lr": (lambda: pf.inject_hyperparams(pf.adamw)(learning_rate=-1.0), "learning_rate"),
    "inject_b1_one": (lambda: pf.inject_hyperparams(pf.adamw)(learning_rate=1e-3, b1=1.0), "b1"),
    "compile_non_transform": (lambda: pf.compile(lambda g: g), "Transform"),
    "cosine_negative_peak": (lambda: pf.cosine_schedule(-1.0, 10, 100), "peak"),
    "cosine_nan_final": (lambda: pf.cosine_schedule(1.0, 10, 100, final=NAN), "final"),
    "cosine_total_below_warmup": (lambda: pf.cosine_schedule(1.0, 10, 5), "total"),
    "warmup_negative": (lambda: pf.linear_warmup(1.0, -5), "warmup"),
    "wsd_bad_shape": (lambda: pf.wsd_schedule(1.0, 1, 1, 1, shape="cubic"), "shape"),
    "wsd_exponential_to_zero": (lambda: pf.wsd_schedule(1.0, 1, 1, 1, shape="exponential"), "final"),
    "wsd_negative_decay": (lambda: pf.wsd_schedule(1.0, 1, 1, -3), "decay"),
    "power_negative_gamma": (lambda: pf.power_decay_schedule(1.0, 100, gamma=-1.0), "gamma"),
    "power_total_not_above_warmup": (lambda: pf.power_decay_schedule(1.0, 10, warmup=10), "total"),
    "join_wrong_count": (lambda: pf.join_schedules([pf.constant_schedule(1.0)], [5]), "boundaries"),
    "join_decreasing": (
        lambda: pf.join_schedules([pf.constant_schedule(1.0)] * 3, [10, 5]),
        "boundaries",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HYPERPARAMETERS))
def test_bad_hyperparameter_names_the_argument(case):
    build, word = BAD_HYPERPARAMETERS[case]
    with pytest.raises(InvalidArgument) as info:
        build()
    assert word in str(info.value), str(info.value)
    assert info.value.exit_code == EXIT_BAD_INPUT


def test_bad_hyperparameter_message_says_what_was_expected():
    with pytest.raises(InvalidArgument) as info:
        pf.adamw(b1=1.0)
    msg = str(info.value)
    assert "scale_by_adam" in msg and "b1=1.0" in msg and "[0.0, 1.0)" in msg, msg


@pytest.mark.parametrize("method", ["update", "step"])
def test_compile_before_init(method):
    fc = pf.compile(pf.adamw(1e-3), jit=False)
    with pytest.raises(InvalidArgument, match="init"):
        getattr(fc, method)(_grads(), None, _params())


def test_partition_label_not_in_transforms_names_the_parameter():
    opt = pf.partition({"x": pf.identity()}, lambda path, p: "y" if path == "a" else "x")
    with pytest.raises(InvalidArgument, match=r"'a'.*'y'"):
        opt.init(_params())


def test_mask_tree_without_an_entry_names_the_parameter():
    opt = pf.adamw(1e-3, weight_decay=0.1, mask={"a": True, "b": [False]})
    params = _params()
    state = opt.init(params)
    with pytest.raises(InvalidArgument, match=r"'b\.1'"):
        opt.update(_grads(), state, params)


def test_state_from_dict_names_the_missing_key():
    params = _params()
    opt = pf.adamw(1e-3)
    state = opt.init(params)
    d = pf.state_to_dict(state)
    key = next(k for k in d if k.endswith("nu.b.1"))
    del d[key]
    with pytest.raises(TreeMismatch, match=r"nu\.b\.1"):
        pf.state_from_dict(state, d)
