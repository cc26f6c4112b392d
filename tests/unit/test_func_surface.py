"""pgs.func's public surface: an explicit ``__all__``, no name shared by a function and a
submodule, and each transform's stage (direction or step) declared on the transform."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.func.base import BRANCHES, DIRECTION, SOME_PARAMS, STEP, _has_step, no_step_stage

PACKAGES = ("pgs.func", "pgs.func.losses", "pgs.func.kernels")


def _submodules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [name for _, name, _ in pkgutil.iter_modules(pkg.__path__)]


def _public(pkg) -> list[str]:
    """``__all__``, or (a package without one) its non-module names without a leading underscore."""
    if hasattr(pkg, "__all__"):
        return list(pkg.__all__)
    return [n for n, v in vars(pkg).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]


def _import_every_submodule() -> None:
    for package in PACKAGES:
        for name in _submodules(package):
            try:
                importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:  # an optional dependency (Triton) not installed
                if (err.name or "").startswith("pgs"):
                    raise


@pytest.mark.parametrize("package", PACKAGES)
def test_no_public_name_is_also_a_submodule_name(package):
    pkg = importlib.import_module(package)
    public = set(_public(pkg))
    clash = sorted(public & set(_submodules(package)))
    assert not clash, f"{package}: {clash} name both a public object and a submodule (rename the module)"


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_submodules_rebinds_no_public_name(package):
    pkg = importlib.import_module(package)
    public = _public(pkg)
    before = {n: getattr(pkg, n) for n in public}
    _import_every_submodule()
    changed = sorted(n for n in public if getattr(pkg, n) is not before[n])
    assert not changed, f"{package}: importing its submodules rebound {changed}"
    assert not [n for n in public if isinstance(getattr(pkg, n), types.ModuleType)]


def test_all_is_exactly_the_public_surface():
    _import_every_submodule()  # submodule attributes appear; they are not the surface
    names = pf.__all__
    assert isinstance(names, list) and len(names) == len(set(names)), "pgs.func.__all__ has duplicates"
    missing = [n for n in names if not hasattr(pf, n)]
    assert not missing, f"pgs.func.__all__ names what pgs.func does not define: {missing}"
    public = {n for n, v in vars(pf).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public - set(names) == set(), f"public in pgs.func but not in __all__: {sorted(public - set(names))}"
    assert set(names) - public == set()
    assert dir(pf) == sorted(names)  # tab completion shows the surface, not the submodules


def test_star_import_gives_the_surface():
    ns: dict = {}
    exec("from pgs.func import *", ns)
    assert {n for n in ns if not n.startswith("__")} == set(pf.__all__)


#: What each pgs building block is, as the runtime's "does this chain step?" check needs it.
EXPECTED_STAGES = {
    "scale_by_learning_rate": (lambda: pf.scale_by_learning_rate(0.1), STEP),
    "hyperball": (lambda: pf.hyperball(0.1), STEP),
    "identity": (pf.identity, DIRECTION),
    "scale_by_adam": (pf.scale_by_adam, DIRECTION),
    "scale_by_adam8bit": (pf.scale_by_adam8bit, DIRECTION),
    "scale_by_lion": (pf.scale_by_lion, DIRECTION),
    "scale_by_lion8bit": (pf.scale_by_lion8bit, DIRECTION),
    "scale_by_muon": (pf.scale_by_muon, DIRECTION),
    "scale_by_sage": (pf.scale_by_sage, DIRECTION),
    "scale_by_sgd_momentum": (pf.scale_by_sgd_momentum, DIRECTION),
    "clip_by_global_norm": (lambda: pf.clip_by_global_norm(1.0), DIRECTION),
    "clip_by_norm_per_tensor": (lambda: pf.clip_by_norm_per_tensor(1.0), DIRECTION),
    "zclip": (pf.zclip, DIRECTION),
    "adagc": (pf.adagc, DIRECTION),
    "mona": (pf.mona, DIRECTION),
    "add_decayed_weights": (lambda: pf.add_decayed_weights(0.1), DIRECTION),
    "add_corrected_decayed_weights": (lambda: pf.add_corrected_decayed_weights(0.1, 1e-3, 1e-3), DIRECTION),
    "partition": (lambda: pf.partition({"a": pf.identity()}, lambda p, x: "a"), BRANCHES),
    "masked": (lambda: pf.masked(pf.identity(), lambda p, x: True), SOME_PARAMS),
    "ema": (pf.ema, None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_STAGES))
def test_each_transform_declares_its_stage(name):
    make, stage = EXPECTED_STAGES[name]
    t = make()
    assert t.name == name
    assert t.stage == stage


def test_stage_is_read_from_the_transform_not_its_name():
    direction = lambda: (lambda p, **e: (), lambda u, s, p=None, **e: (u, s))  # noqa: E731
    # a user's transform that borrows a pgs name but declares nothing is trusted
    impostor = pf.Transform(*direction(), name="scale_by_adam")
    assert _has_step(pf.chain(impostor)) is None and no_step_stage(pf.chain(impostor)) is None
    # one that declares itself a direction, under any name, is a direction
    declared = pf.Transform(*direction(), name="my_direction", stage=DIRECTION)
    assert "no learning-rate stage" in no_step_stage(pf.chain(declared))
    stepping = pf.Transform(*direction(), name="my_step", stage=STEP)
    assert no_step_stage(pf.chain(declared, stepping)) is None
    # wrappers that rebuild a transform keep its stage
    assert pf.inject_hyperparams(pf.scale_by_learning_rate)(learning_rate=0.1).stage == STEP
    with pytest.raises(InvalidArgument, match="stage='sideways'"):
        pf.Transform(*direction(), name="odd", stage="sideways")


def test_no_step_stage_verdicts_unchanged():
    assert no_step_stage(pf.chain(pf.scale_by_adam())) is not None
    assert no_step_stage(pf.adamw(1e-3)) is None
    assert no_step_stage(pf.chain(pf.scale_by_adam(), pf.hyperball(0.01))) is None
    assert no_step_stage(pf.masked(pf.adamw(1e-3), lambda p, x: True)) is not None
    split = pf.partition({"a": pf.adamw(1e-3), "b": pf.scale_by_adam()}, lambda p, x: "a")
    assert "a partition branch" in no_step_stage(split)
    assert no_step_stage(pf.accumulate(pf.adamw(1e-3), every=2)) is None
    assert no_step_stage(pf.lion8bit(1e-3)) is None and no_step_stage(pf.adamw8bit(1e-3)) is None


def _factories_with(parameter: str) -> set[str]:
    """The transform factories of pgs.func (``-> Transform``) with that parameter."""
    import inspect

    sigs = {n: inspect.signature(getattr(pf, n)) for n in pf.__all__ if inspect.isfunction(getattr(pf, n))}
    return {n for n, sig in sigs.items() if "Transform" in str(sig.return_annotation) and parameter in sig.parameters}


def test_every_factory_taking_a_learning_rate_declares_it():
    """A spec hands its [schedule] to the factories that declare ``takes_learning_rate``, and to
    no other: one that takes ``learning_rate`` without declaring it would train at its default."""
    declared = {n for n in pf.__all__ if getattr(getattr(pf, n), "takes_learning_rate", False)}
    takes = _factories_with("learning_rate")
    assert declared == takes, f"undeclared: {sorted(takes - declared)}; declared without it: {sorted(declared - takes)}"
    assert {"adamw", "lion", "sgd", "scale_by_learning_rate", "hyperball", "add_corrected_decayed_weights"} <= declared
