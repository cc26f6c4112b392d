"""Conformance entries for the research transforms (issue 3): Muon, MONA, Hyperball, AdaGC,
ZClip, AdamC, SAGE, EMA, schedule-free.  Picked up by ``registry.py``."""

from __future__ import annotations

import torch

import pgs.func as pf
from registry import Entry, Inject

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def _is_matrix(path, p):
    return p.ndim >= 2


def _by_ndim(path, p):
    return "muon" if p.ndim >= 2 else "fallback"


def _first_is_embedding(path, p):
    return p.ndim == 2 and path.endswith("0")


_sched = pf.cosine_schedule(peak=1e-2, warmup=2, total=10, final=1e-3)

ENTRIES = [
    Entry(
        "scale_by_muon",
        lambda: pf.scale_by_muon(momentum=0.9, adjust_lr="match_rms_adamw"),
        min_ndim=2,
        tol=1e-6,
        inject=Inject(pf.scale_by_muon, dict(momentum=0.9, ns_steps=5, adjust_lr="match_rms_adamw"),
                      static_args=("ns_steps",)),
        notes="bf16 Newton-Schulz: same-shape matrices are batched, on both paths",
    ),
    Entry(
        "scale_by_muon_fp32",
        lambda: pf.scale_by_muon(nesterov=False, ns_dtype=F32, mu_dtype=F32),
        covers=("scale_by_muon",),
        tol=1e-6,
        notes="fp32 iteration, fp32 momentum, no Nesterov; 0-d and 1-D leaves are 1×n rows",
    ),
    Entry(
        "muon",
        lambda: pf.muon(0.02, weight_decay=0.1, adam_lr=1e-3, route=_by_ndim, ns_dtype=F32),
        needs_params=True,
        tol=1e-4,
        inject=Inject(pf.muon, dict(learning_rate=0.02, weight_decay=0.1, adam_lr=1e-3, ns_steps=5, route=_by_ndim,
                                    ns_dtype=F32),
                      static_args=("ns_steps",)),
        jit_check=True,
        min_ndim=2,
        notes="a partition: Muon for ndim >= 2, AdamW for the rest.  fp32 Newton-Schulz: under torch.compile a "
              "bf16 iteration rounds differently and small singular directions move by a few %.  min_ndim=2 because a tree whose "
              "muon branch is empty hands add_decayed_weights params=None (a core partition issue); "
              "muon_lion_fallback covers mixed trees",
    ),
    Entry(
        "muon_lion_fallback",
        lambda: pf.muon(0.02, weight_decay=0.0, adam_lr=1e-4, fallback="lion"),
        covers=("muon", "muon_route"),
        tol=1e-6,
        notes="default route (muon_route); weight_decay=0 drops the decay stage, so params are not needed",
    ),
    Entry(
        "mona",
        lambda: pf.mona(alpha=0.5, beta=0.9),
        inject=Inject(pf.mona, dict(alpha=0.5, beta=0.9)),
        jit_check=True,
    ),
    Entry(
        "hyperball",
        lambda: pf.hyperball(0.1, mask=lambda path, p: not path.endswith("head")),
        needs_params=True,
        tol=1e-4,
        inject=Inject(pf.hyperball, dict(learning_rate=0.1)),
        jit_check=True,
        notes="emits W' − W, a difference of nearly equal numbers: flat-path norms (summed in another "
              "order) move it by ~1e-7·‖W‖, i.e. ~1e-5 of the update",
    ),
    Entry(
        "adamh",
        lambda: pf.adamh(_sched, b2=0.95),
        needs_params=True,
        tol=1e-4,
        inject=Inject(pf.adamh, dict(learning_rate=_sched, b2=0.95)),
    ),
    Entry(
        "muonh",
        lambda: pf.muonh(0.05, adam_lr=1e-3, route=_by_ndim),
        needs_params=True,
        tol=1e-4,
        inject=Inject(pf.muonh, dict(learning_rate=0.05, adam_lr=1e-3, ns_steps=5, route=_by_ndim),
                      static_args=("ns_steps",)),
    ),
    Entry(
        "adagc",
        lambda: pf.adagc(lambda_rel=1.05, beta=0.98, lambda_abs=1.0, warmup_steps=2),
        tol=1e-5,
        inject=Inject(pf.adagc, dict(lambda_rel=1.05, beta=0.98, lambda_abs=1.0, warmup_steps=2)),
        jit_check=True,
        notes="warmup_steps=2 so that the per-tensor (post-warmup) rule runs within 3 steps",
    ),
    Entry(
        "zclip",
        lambda: pf.zclip(alpha=0.9, z_thresh=0.5, warmup_steps=2, max_grad_norm=5.0),
        tol=1e-5,
        inject=Inject(pf.zclip, dict(alpha=0.9, z_thresh=0.5, warmup_steps=2, max_grad_norm=5.0)),
        jit_check=True,
        notes="a low threshold and a 2-step warmup make step 3 a spike often",
    ),
    Entry(
        "zclip_skip",
        lambda: pf.zclip(alpha=0.9, z_thresh=0.5, warmup_steps=2, mode="skip"),
        covers=("zclip",),
        tol=1e-5,
    ),
    Entry(
        "adamc",
        lambda: pf.adamc(_sched, b2=0.95, weight_decay=0.1, peak_lr=1e-2),
        needs_params=True,
        inject=Inject(pf.adamc, dict(learning_rate=_sched, b2=0.95, weight_decay=0.1, peak_lr=1e-2)),
        jit_check=True,
        covers=("adamc", "add_corrected_decayed_weights"),
    ),
    Entry(
        "scale_by_sage",
        lambda: pf.scale_by_sage(b1=0.9, b2=0.99, embedding=_first_is_embedding),
        tol=1e-6,
        inject=Inject(pf.scale_by_sage, dict(b1=0.9, b2=0.99, embedding=_first_is_embedding)),
        notes="matrix transform (column statistics): the flat executor hands it views",
    ),
    Entry(
        "sage",
        lambda: pf.sage(1e-3, weight_decay=0.1, order="official", embedding=_is_matrix),
        needs_params=True,
        tol=1e-6,
        inject=Inject(pf.sage, dict(learning_rate=1e-3, weight_decay=0.1, order="official", embedding=_is_matrix)),
    ),
    Entry(
        "ema",
        lambda: pf.ema(0.9),
        inject=Inject(pf.ema, dict(decay=0.9)),
        jit_check=True,
        notes="updates are the parameters; the emitted 'update' is the current average",
    ),
    Entry(
        "ema_debias_warmup",
        lambda: pf.ema(0.99, debias=True, warmup=True),
        covers=("ema",),
    ),
    Entry(
        "schedule_free_adamw",
        lambda: pf.schedule_free_adamw(_sched, b1=0.9, b2=0.99, weight_decay=0.1, mask=_is_matrix),
        needs_params=True,
        tol=1e-6,
        inject=Inject(pf.schedule_free_adamw, dict(learning_rate=_sched, b1=0.9, b2=0.99, weight_decay=0.1,
                                                   mask=_is_matrix)),
        jit_check=True,
        covers=("schedule_free_adamw", "schedule_free"),
        notes="a schedule: the averaging weights follow it; the update is c(z − y) + (1 − β(1 − c))u",
    ),
    Entry(
        "schedule_free_sgd_fp32_z",
        lambda: pf.schedule_free(pf.sgd(1e-2), 1e-2, b1=0.5, weight_lr_power=0.0, z_dtype=F32),
        needs_params=True,
        tol=1e-6,
        inject=Inject(pf.schedule_free, dict(opt=pf.sgd(1e-2), learning_rate=1e-2, b1=0.5, weight_lr_power=0.0,
                                             z_dtype=F32)),
        covers=("schedule_free",),
        notes="z stored in fp32 whatever the parameters' dtype; uniform averaging (p = 0)",
    ),
]
