"""The conformance registry: every public transform, registered once.

Each ``Entry`` says how to build a transform and what the conformance suite
(``test_conformance.py``) may feed it.  A new transform joins the suite by being registered,
not by copying tests: append an ``Entry`` to ``ENTRIES`` here, or, without touching this
file, define ``ENTRIES = [...]`` in a sibling module ``registry_research.py`` or
``registry_8bit.py``; those are picked up when they exist.

    # property_tests/registry_research.py
    from registry import Entry, Inject
    import pgs.func as pf

    ENTRIES = [
        Entry("muon", lambda: pf.muon(lr=0.02), min_ndim=2, tol=1e-2,
              inject=Inject(pf.muon, dict(lr=0.02))),
    ]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch

import pgs.func as pf

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
ALL_FLOATS = (F32, F64, BF16)


@dataclasses.dataclass(frozen=True)
class Inject:
    """How to build the entry through ``pf.inject_hyperparams``.

    ``pf.inject_hyperparams(factory, static_args)(**kwargs)`` must give the same results as
    ``factory(**kwargs)`` (which should be what ``Entry.make`` builds).
    """

    factory: Callable[..., pf.Transform]
    kwargs: dict
    static_args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One transform under test.

    Attributes:
        name: unique id (the pytest parameter id).
        make: builds a fresh transform.
        dtypes: leaf dtypes the generated trees may use (mixed within one tree).
        needs_params: ``update`` needs ``params`` (and must raise a ``pgs.errors`` error
            without them); otherwise ``update(g, s, None)`` must equal ``update(g, s, params)``.
        accumulate_ok: ``pf.accumulate(make(), k)`` over k micro-steps equals one step on the
            mean gradient.  This holds for every transform (the wrapper feeds the mean), so
            set it False only for a transform that reads call-time context that accumulation
            changes (``extra`` such as the loss), and say why in ``notes``.
        tol: relative tolerance when two computation paths are compared (flat layout vs
            per-parameter, injected vs plain).  0 means bitwise equal.  Reductions (norms)
            are summed in a different order on the flat layout, so give them ~1e-6.  For bf16
            leaves a nonzero tol is widened to one bf16 ulp.
        inject: the ``inject_hyperparams`` recipe, or None when the factory takes no numbers.
        jit_check: also run one ``pf.compile(jit=True)`` check (torch.compile on CPU is slow,
            so only a representative subset does).
        jit_tol: relative tolerance of that check; None means ``max(tol, 1e-5)``.  Inductor
            fuses and reorders, so low-precision internals (bf16 Newton-Schulz) round
            differently from eager: give those ~1e-2 (docs/techniques/README.md, "Float policy").
        min_ndim: generated leaves have at least this many dims (2 for matrix transforms).
        max_dim: largest size of one dim in generated leaves.
        covers: the public ``pf`` factories this entry exercises (defaults to ``name``);
            ``test_every_public_transform_is_registered`` checks coverage through it.
        notes: anything a reader of a failure should know.
    """

    name: str
    make: Callable[[], pf.Transform]
    dtypes: tuple[torch.dtype, ...] = ALL_FLOATS
    needs_params: bool = False
    accumulate_ok: bool = True
    tol: float = 0.0
    inject: Inject | None = None
    jit_check: bool = False
    jit_tol: float | None = None
    min_ndim: int = 0
    max_dim: int = 40
    covers: tuple[str, ...] = ()
    notes: str = ""

    def covered(self) -> tuple[str, ...]:
        return self.covers or (self.name,)


def _is_matrix(path: str, p: Any) -> bool:
    return p.ndim >= 2


def _by_ndim(path: str, p: Any) -> str:
    return "matrix" if p.ndim >= 2 else "other"


_sched = pf.cosine_schedule(peak=1e-2, warmup=2, total=10, final=1e-3)

ENTRIES: list[Entry] = [
    Entry("identity", pf.identity, notes="no hyperparameters to inject"),
    Entry(
        "scale_by_adam",
        lambda: pf.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8, eps_root=1e-12),
        inject=Inject(pf.scale_by_adam, dict(b1=0.9, b2=0.99, eps=1e-8, eps_root=1e-12)),
        jit_check=True,
    ),
    Entry(
        "scale_by_adam_fp32_moments",
        lambda: pf.scale_by_adam(mu_dtype=F32, nu_dtype=F32),
        inject=Inject(pf.scale_by_adam, dict(mu_dtype=F32, nu_dtype=F32)),
        covers=("scale_by_adam",),
        notes="fp32 moments for bf16 params: state dtypes differ from the params'",
    ),
    Entry(
        "scale_by_lion",
        lambda: pf.scale_by_lion(b1=0.9, b2=0.99),
        inject=Inject(pf.scale_by_lion, dict(b1=0.9, b2=0.99)),
    ),
    Entry(
        "scale_by_sgd_momentum",
        lambda: pf.scale_by_sgd_momentum(momentum=0.9, nesterov=True),
        inject=Inject(pf.scale_by_sgd_momentum, dict(momentum=0.9, nesterov=True)),
    ),
    Entry(
        "scale_by_learning_rate",
        lambda: pf.scale_by_learning_rate(_sched),
        inject=Inject(pf.scale_by_learning_rate, dict(learning_rate=_sched)),
        notes="a schedule: the injected value is re-evaluated at every step",
    ),
    Entry(
        "add_decayed_weights",
        lambda: pf.add_decayed_weights(0.1, mask=_is_matrix),
        needs_params=True,
        inject=Inject(pf.add_decayed_weights, dict(weight_decay=0.1, mask=_is_matrix)),
    ),
    Entry(
        "clip_by_global_norm",
        lambda: pf.clip_by_global_norm(0.5),
        tol=1e-6,
        inject=Inject(pf.clip_by_global_norm, dict(max_norm=0.5)),
        jit_check=True,
        notes="the flat layout sums squares in a different order",
    ),
    Entry(
        "clip_by_norm_per_tensor",
        lambda: pf.clip_by_norm_per_tensor(0.5),
        tol=1e-6,
        inject=Inject(pf.clip_by_norm_per_tensor, dict(max_norm=0.5)),
    ),
    Entry(
        "adamw",
        lambda: pf.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1, mask=_is_matrix),
        needs_params=True,
        inject=Inject(pf.adamw, dict(learning_rate=1e-2, b1=0.9, b2=0.95, weight_decay=0.1, mask=_is_matrix)),
        jit_check=True,
        covers=("adamw", "chain"),
    ),
    Entry(
        "lion",
        lambda: pf.lion(1e-3, b1=0.95, b2=0.98, weight_decay=0.1),
        needs_params=True,
        inject=Inject(pf.lion, dict(learning_rate=1e-3, b1=0.95, b2=0.98, weight_decay=0.1)),
        jit_check=True,
    ),
    Entry(
        "sgd",
        lambda: pf.sgd(1e-2, momentum=0.9, nesterov=False, weight_decay=1e-2),
        needs_params=True,
        inject=Inject(pf.sgd, dict(learning_rate=1e-2, momentum=0.9, nesterov=False, weight_decay=1e-2)),
    ),
    Entry(
        "named_chain",
        lambda: pf.named_chain(
            ("clip", pf.clip_by_global_norm(1.0)),
            ("adam", pf.scale_by_adam(b2=0.95)),
            ("lr", pf.scale_by_learning_rate(_sched)),
        ),
        tol=1e-6,
        notes="takes transforms, not numbers: nothing to inject",
    ),
    Entry(
        "masked",
        lambda: pf.masked(pf.scale_by_adam(), _is_matrix),
        inject=Inject(pf.masked, dict(inner=pf.scale_by_adam(), mask=_is_matrix)),
    ),
    Entry(
        "partition",
        lambda: pf.partition(
            {"matrix": pf.adamw(1e-2, weight_decay=0.1), "other": pf.lion(1e-3, weight_decay=0.1)}, _by_ndim
        ),
        needs_params=True,
        jit_check=True,
        notes="labels split the flat groups; each branch keeps its own state (both decay, so "
              "params are needed whichever branch a tree falls into)",
    ),
    Entry(
        "accumulate",
        lambda: pf.accumulate(pf.adamw(1e-2, weight_decay=0.1), every=2),
        needs_params=True,
        inject=Inject(pf.accumulate, dict(opt=pf.adamw(1e-2, weight_decay=0.1), every=2), static_args=("every",)),
        notes="reads its micro-step counter on the host: not jit-checked",
    ),
    Entry(
        "inject_hyperparams",
        lambda: pf.inject_hyperparams(pf.adamw)(learning_rate=_sched, b1=0.9, weight_decay=0.1),
        needs_params=True,
        jit_check=True,
        notes="the wrapper itself; injecting it twice is meaningless",
    ),
]


def _load_sibling(name: str) -> list[Entry]:
    """``ENTRIES`` of an optional sibling module, or [] when the file does not exist."""
    path = Path(__file__).with_name(f"{name}.py")
    if not path.exists():
        return []
    if name in sys.modules:
        return list(sys.modules[name].ENTRIES)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)  # an error in the sibling surfaces here, on purpose
    entries = list(getattr(mod, "ENTRIES"))
    for e in entries:
        if not isinstance(e, Entry):
            raise TypeError(f"{path.name}: ENTRIES holds a {type(e).__name__}, expected registry.Entry")
    return entries


# Siblings import ``Entry`` from this module; make sure they find it under its plain name
# even when this file was imported some other way.
sys.modules.setdefault("registry", sys.modules[__name__])
for _sibling in ("registry_research", "registry_8bit"):
    ENTRIES.extend(_load_sibling(_sibling))

#: name -> entry; ``test_registry_names_are_unique`` guards against a name given twice.
BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}
