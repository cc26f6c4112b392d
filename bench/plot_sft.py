"""Plots of the one-GPU SFT results (issue 8) for docs/performance.md.

    python bench/plot_sft.py                      # reads bench/results/, writes docs/img/
    python bench/plot_sft.py --results DIR --out DIR
    python bench/plot_sft.py --inputs s2          # the session-2 plots (probe rows, lion8bit 5e-5)

Inputs (``--inputs latest``, the default):

- ``2026-11-30-sft-step-4b-alternated-2.json``: Qwen3-4B 1×4096 (``bench/sft_step.py``:
  ``results``, one row per variant run with ``tok_s``, ``peak_gib``, ``mfu``): HF compiled layers
  + AC against pgs release with sublayer checkpoints, offloaded inputs and tied slabs, each run
  twice, alternated, in one call (as ``2026-11-30-sft-step-4b-alternated.json``; a variant's
  repeats are drawn as one point at their mean, the range in its label).  ``--sft-4b
  2026-11-29-sft-step-4b-5.json`` draws an earlier call (more pgs variants), ``--only-4b`` picks
  variants of the file.
- ``2026-11-30-sft-step-06b-6.json``: Qwen3-0.6B 8×4096 packed, HF + Liger (the rows as single causal
  sequences, the usual peer setup; pgs's varlen attention) against pgs release with cuDNN's and
  with FlashAttention-2's packed kernel, all from one call (``--sft-06b
  2026-11-30-sft-step-06b-3.json``: an earlier call, with HF + Liger on SDPA's block mask).
- ``LATEST_CONVERGE``: per-step losses of ``bench/sft_converge.py`` runs, one image each:
  ``2026-11-30-sft-converge-finetune-bpe.json`` (fine-tuning on BPE text from shared AdamW-trained
  weights: HF AdamW, pgs lion8bit, bitsandbytes Lion8bit, pgs adamw8bit) as ``sft_converge.png``,
  ``2026-11-30-sft-converge-bpe.json`` (the same text from scratch) as
  ``sft_converge_scratch.png``,
  ``2026-11-30-sft-converge-500.json`` (500 steps of a 256-state Markov chain from scratch) as
  ``sft_converge_markov.png``.  ``--converge FILE`` draws one file as ``sft_converge.png``.

``--sft-4b``, ``--sft-06b`` and ``--converge`` name other files (relative to ``--results``).
``--inputs s2`` draws the first plots (2026-11-29) instead, from
``2026-11-29-probe-sft-step-variants.json`` (pgs rows), ``2026-11-29-sft-step-4b-hf-final.json``,
``2026-11-29-sft-step-06b-hf-final.json`` (HF rows) and ``2026-11-29-sft-converge.json``.

Outputs: ``sft_4b_memory_speed.png`` (peak allocated GiB vs tok/s, 4B and 0.6B panels) and
``sft_converge*.png`` (loss vs step). A missing file or row is skipped with a note on stderr.
Needs matplotlib only (Agg backend, no display).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOAL_GIB_4B = 12.0  # issue 8: <= 12 GiB peak allocated at the 4B shape, at >= HF's tok/s
GOAL_SPEEDUP_06B = 1.25  # issue 8: >= 1.25x the best HF setup's tok/s at the 0.6B shape

LATEST_FILES = dict(sft_4b="2026-11-30-sft-step-4b-alternated-2.json", sft_06b="2026-11-30-sft-step-06b-6.json")
# (bench/sft_converge.py JSON, image name): fine-tuning on BPE text (the check), the same
# text from scratch, and session 7's Markov chain from scratch
LATEST_CONVERGE = (("2026-11-30-sft-converge-finetune-bpe.json", "sft_converge.png"),
                   ("2026-11-30-sft-converge-bpe.json", "sft_converge_scratch.png"),
                   ("2026-11-30-sft-converge-500.json", "sft_converge_markov.png"))

# Readable names for bench/sft_step.py's variant ids; an unknown id is shown as it is.
VARIANT_LABELS = {
    "hf_compiled_ac": "HF compiled layers + AC",
    "hf_compiled": "HF compiled layers, no AC",
    "hf_liger": "HF Liger, no AC",
    "hf_liger_ac": "HF Liger + AC",
    "hf_eager_ac": "HF eager + AC",
    "hf_liger_varlen": "HF Liger + varlen attention, no AC",
    "hf_liger_causal": "HF Liger, rows as single causal sequences\n(documents not isolated; the usual peer setup), no AC",
    "pgs_release_slabs_sub_varlen": ("pgs release + sublayer ckpt + offload + slabs\n"
                                     "(varlen: unpacked rows as dense SDPA)"),
    "hf_compiled_varlen": "HF compiled layers + varlen attention, no AC",
    "pgs_release": "pgs release",
    "pgs_release_slabs": "pgs release + slabs",
    "pgs_release_slabs_pg": "pgs release + slabs + per-param",
    "pgs_release_slabs_pg_tiled": "pgs release + slabs + per-param + tiled MLP",
    "pgs_release_tiled": "pgs release + tiled MLP",
    "pgs_release_slabs_sub": "pgs release + sublayer ckpt + offload + slabs",
    "pgs_release_slabs_pg_sub": "pgs release + sublayer ckpt + offload + slabs\n+ per-param groups",
    "pgs_release_noac": "pgs release, no AC",
    "pgs_release_varlen": "pgs release + AC + varlen",
    "pgs_release_noac_varlen": "pgs release, no AC + varlen",
}

# Where a row's label goes: offset of the text from its point in points (dx, dy) and the text's
# horizontal alignment. A variant not listed is labelled just right of its point.
LABEL_OFFSET_4B = {
    "pgs_release": (-10, 34, "center"),
    "pgs_release_slabs_pg": (14, 0, "left"),
    "pgs_release_slabs_pg_tiled": (14, 0, "left"),
}
LABEL_OFFSET_06B = {
    "hf_liger": (-12, -44, "right"),
    "hf_liger_causal": (-14, -62, "right"),
    "hf_compiled": (-12, -44, "right"),
    "hf_liger_varlen": (-34, -30, "right"),
    "pgs_release_noac_varlen": (-16, 52, "right"),
    "pgs_release_varlen": (12, -6, "left"),
    "pgs_release_noac": (-22, 30, "right"),
    "pgs_release_noac_varlen+fa2": (-34, 6, "right"),
}


def note(msg: str) -> None:
    print(f"plot_sft: {msg}", file=sys.stderr)


def load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        note(f"skipping {os.path.basename(path)}: {e}")
        return None


def step_rows(data, name: str) -> list[dict]:
    """``bench/sft_step.py``'s timed rows (with ``tok_s`` and ``peak_gib``), in file order."""
    if not data:
        return []
    out = []
    for r in data.get("results", []):
        if "tok_s" in r and "peak_gib" in r:
            out.append(r)
        else:
            note(f"{name}: variant {r.get('variant')} has no tok_s/peak_gib ({r.get('error', 'no error')}); skipped")
    if not out:
        note(f"{name}: no timed rows")
    return out


def merge_repeats(rows: list[dict]) -> list[dict]:
    """One row per variant: repeats (a variant run again in the same call) become their mean,
    with ``runs`` holding each run's tok/s."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    out = []
    for v, rs in by.items():
        m = dict(rs[0])
        if len(rs) > 1:
            m["runs"] = [x["tok_s"] for x in rs]
            for k in ("tok_s", "peak_gib", "mfu"):
                if all(k in x for x in rs):
                    m[k] = sum(x[k] for x in rs) / len(rs)
        out.append(m)
    return out


def is_hf(r: dict) -> bool:
    return r["variant"].startswith("hf_")


def is_varlen(r: dict) -> bool:
    return r.get("attn_implementation") == "varlen" or r["variant"].endswith("_varlen")


def style(r: dict) -> dict:
    """Square = HF, circle = pgs; filled = SDPA attention, hollow = varlen attention."""
    col = "black" if is_hf(r) else "tab:blue"
    st = dict(marker="s" if is_hf(r) else "o", s=80 if is_hf(r) else 90, zorder=5, linewidths=2)
    if is_varlen(r):
        st.update(facecolor="white", edgecolor=col)
    else:
        st.update(color=col)
    return st


def put_label(ax, r: dict, text: str, offsets: dict) -> None:
    dx, dy, ha = offsets.get(r["variant"], (12, 0, "left"))
    box = dict(boxstyle="square,pad=0.15", fc="white", ec="none", alpha=0.85)
    arrow = None if (abs(dx) <= 16 and dy == 0) else dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0,
                                                           shrinkB=5)
    ax.annotate(text, (r["peak_gib"], r["tok_s"]), xytext=(dx, dy), textcoords="offset points", fontsize=8.5,
                ha=ha, va="center", bbox=box, arrowprops=arrow, zorder=6)


def label_of(variant: str) -> str:
    """The readable name of a variant id; ``+switch`` suffixes (bench/sft_step.py SWITCHES)
    follow in brackets."""
    base, *switches = variant.split("+")
    return VARIANT_LABELS.get(base, base) + (f" [+{', +'.join(switches)}]" if switches else "")


def row_text(r: dict, extra: str = "", gib_digits: int = 2) -> str:
    runs = r.get("runs")
    spread = f" (runs {min(runs):,.0f}-{max(runs):,.0f})" if runs else ""
    return (f"{label_of(r['variant'])}\n"
            f"{r['tok_s']:,.0f} tok/s{spread}, {r['peak_gib']:.{gib_digits}f} GiB"
            + (f", MFU {r['mfu']:.0%}" if "mfu" in r else "") + extra)


def break_marks(fig, ax_left, ax_right) -> None:
    """The // marks between the two halves of a broken x axis."""
    ax_left.spines["right"].set_visible(False)
    ax_right.spines["left"].set_visible(False)
    k = dict(transform=fig.transFigure, color="k", clip_on=False, lw=1)
    for ax, side in ((ax_left, 1), (ax_right, 0)):
        p = ax.get_position()
        x = p.x1 if side else p.x0
        for y in (p.y0, p.y1):
            fig.lines.append(plt.Line2D([x - 0.004, x + 0.004], [y - 0.012, y + 0.012], **k))


def in_goal_4b(r: dict, hf: dict) -> bool:
    """Issue 8's 4B goal: at most 12 GiB peak allocated AND at least HF's tok/s (both halves)."""
    return r["peak_gib"] <= GOAL_GIB_4B and r["tok_s"] >= hf["tok_s"]


def panel_4b(fig, gs_left, gs_right, rows: list[dict], name: str) -> None:
    """Qwen3-4B 1×4096: a broken x axis (pgs near 12-13 GiB, HF near 32 GiB)."""
    ax_a = fig.add_subplot(gs_left)
    pgs = [r for r in rows if not is_hf(r)]
    hfs = [r for r in rows if is_hf(r)]
    if not rows:
        ax_a.text(0.5, 0.5, f"no 4B rows ({name})", ha="center", transform=ax_a.transAxes)
        return
    hf = max(hfs, key=lambda r: r["tok_s"]) if hfs else None
    if len(hfs) > 1:
        note(f"{name}: several HF rows; the goal uses the fastest, {hf['variant']}")
    ys = [r["tok_s"] for r in rows]
    lo, hi = min(ys) * 0.84, max(ys) * 1.09
    xs = [r["peak_gib"] for r in pgs] + [GOAL_GIB_4B]
    ax_a.set_xlim(min(xs) - 0.35, max(xs) + 0.75)
    ax_a.set_ylim(lo, hi)
    if hf:  # the goal: at most 12 GiB at HF's tok/s or more (the shaded corner)
        x0 = ax_a.get_xlim()[0]
        ax_a.fill_between([x0, GOAL_GIB_4B], hf["tok_s"], hi, color="tab:green", alpha=0.12, lw=0)
        ax_a.text(x0 + 0.03, hi - (hi - lo) * 0.02, f"goal:\n≤ {GOAL_GIB_4B:g} GiB\nat ≥ HF tok/s",
                  color="darkgreen", fontsize=8.5, va="top", ha="left")
    ax_a.axvline(GOAL_GIB_4B, color="tab:red", ls=":", lw=1.4)
    ax_a.text(GOAL_GIB_4B - 0.015, lo + (hi - lo) * 0.02, f"{GOAL_GIB_4B:g} GiB goal", color="tab:red",
              rotation=90, ha="right", va="bottom", fontsize=8.5)
    for r in pgs:
        ax_a.scatter(r["peak_gib"], r["tok_s"], **style(r))
        extra = ""
        if hf:  # how far from each half of the goal: a row at 11.998 GiB and 0.94x HF is not in the corner
            extra = f"\n= {r['tok_s'] / hf['tok_s']:.2f}× HF tok/s"
            if in_goal_4b(r, hf):
                extra += " (in the goal corner)"
        # three decimals: 12.002 is not <= 12, and 11.998 is only just under it
        put_label(ax_a, r, row_text(r, extra, gib_digits=3), LABEL_OFFSET_4B)
    if hf and not any(in_goal_4b(r, hf) for r in pgs):
        ax_a.text(x0 + 0.03, hf["tok_s"] + (hi - lo) * 0.015, "no pgs row here yet", color="darkgreen",
                  fontsize=8.5, va="bottom", ha="left", style="italic")
    ax_a.set_ylabel("throughput (tokens/s, higher is better)")
    ax_a.set_title(f"Qwen3-4B, 1×4096, full weights trainable, AC on ({name})", fontsize=10, loc="left")
    ax_a.grid(alpha=0.3)
    if not hf:
        note(f"{name}: no HF row: no HF line in the 4B panel")
        ax_a.set_xlabel("peak allocated memory (GiB)")
        return
    ax_b = fig.add_subplot(gs_right, sharey=ax_a)
    for r in hfs:
        ax_b.scatter(r["peak_gib"], r["tok_s"], **style(r))
    ax_b.set_xlim(hf["peak_gib"] - 0.8, hf["peak_gib"] + 0.8)
    ax_b.annotate(row_text(hf).replace(" tok/s, ", " tok/s\n").replace(" GiB, ", " GiB\n").replace(" + AC", "\n+ AC"),
                  (hf["peak_gib"], hf["tok_s"]), xytext=(0, -30), textcoords="offset points", fontsize=8.5,
                  ha="center", va="top", arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6))
    for ax in (ax_a, ax_b):
        ax.axhline(hf["tok_s"], color="black", ls="--", lw=1)
    ax_b.text(hf["peak_gib"], hf["tok_s"] + (hi - lo) * 0.015, "HF tok/s\n(same call)", fontsize=8.5,
              va="bottom", ha="center")
    ax_b.tick_params(axis="y", left=False, labelleft=False)
    ax_b.grid(alpha=0.3)
    break_marks(fig, ax_a, ax_b)
    p0, p1 = ax_a.get_position(), ax_b.get_position()
    fig.text((p0.x0 + p1.x1) / 2, 0.025, "peak allocated memory (GiB; x axis broken between the pgs rows and HF)",
             ha="center", fontsize=9)


def panel_06b(fig, gs, rows: list[dict], name: str) -> None:
    """Qwen3-0.6B 8×4096 packed: the goal is 1.25× the best HF SDPA row (the issue's baselines;
    with a ``_causal`` row that is the usual peer setup, the documents not isolated)."""
    ax = fig.add_subplot(gs)
    if not rows:
        ax.text(0.5, 0.5, f"no 0.6B rows ({name})", ha="center", transform=ax.transAxes)
        return
    hf_sdpa = [r for r in rows if is_hf(r) and not is_varlen(r)]
    hf_var = [r for r in rows if is_hf(r) and is_varlen(r)]
    best = max(hf_sdpa, key=lambda r: r["tok_s"]) if hf_sdpa else None
    best_var = max(hf_var, key=lambda r: r["tok_s"]) if hf_var else None
    goal = best["tok_s"] * GOAL_SPEEDUP_06B if best else None
    ymax = max([r["tok_s"] for r in rows] + ([goal] if goal else [])) * 1.25
    ax.set_xlim(0, max(r["peak_gib"] for r in rows) * 1.1)
    ax.set_ylim(0, ymax)
    if best:
        ax.axhline(best["tok_s"], color="black", ls="--", lw=1)
        ax.text(1, best["tok_s"] - ymax * 0.012,
                f"best HF with SDPA (the issue's baseline):\n{label_of(best['variant']).splitlines()[0]}, "
                f"{best['tok_s']:,.0f} tok/s", fontsize=8, va="top")
        ax.axhline(goal, color="tab:red", ls=":", lw=1.4)
        ax.text(1, goal + ymax * 0.008,
                f"goal: {GOAL_SPEEDUP_06B:g}× best HF SDPA = {goal:,.0f} tok/s", color="tab:red", fontsize=8.5,
                va="bottom", ha="left")
    else:
        note(f"{name}: no HF SDPA row: no goal line in the 0.6B panel")
    if best_var:
        ax.axhline(best_var["tok_s"], color="0.45", ls="--", lw=0.9)
        ax.text(1, best_var["tok_s"] - ymax * 0.008, "HF + varlen tok/s\n(not an issue baseline)",
                color="0.3", fontsize=8, va="top", ha="left")
    for r in rows:
        ax.scatter(r["peak_gib"], r["tok_s"], **style(r))
        extra = ""
        if not is_hf(r) and best:
            extra = f"\n= {r['tok_s'] / best['tok_s']:.2f}× best HF SDPA"
            if best_var and is_varlen(r):
                extra += f", {r['tok_s'] / best_var['tok_s']:.2f}× HF varlen"
        put_label(ax, r, row_text(r, extra), LABEL_OFFSET_06B)
    ax.set_xlabel("peak allocated memory (GiB)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Qwen3-0.6B, 8×4096 packed (HF: AdamW; pgs: release + lion8bit)\nvarlen: cuDNN's THD kernel "
                 "from session 7 (model.varlen_kernel auto), FlashAttention-2 before and with [+fa2]",
                 fontsize=9.5, loc="left")
    ax.grid(alpha=0.3)
    legend = [plt.Line2D([], [], ls="none", marker="s", color="black", ms=8, label="HF, SDPA attention"),
              plt.Line2D([], [], ls="none", marker="s", mfc="white", mec="black", mew=2, ms=8,
                         label="HF, varlen attention"),
              plt.Line2D([], [], ls="none", marker="o", color="tab:blue", ms=8, label="pgs, SDPA attention"),
              plt.Line2D([], [], ls="none", marker="o", mfc="white", mec="tab:blue", mew=2, ms=8,
                         label="pgs, varlen attention")]
    ax.legend(handles=legend, fontsize=8, loc="lower right", framealpha=0.9)


def plot_memory_speed(results: str, out: str, f4b: str, f06b: str, only_4b: list[str] | None = None) -> str | None:
    d4, d06 = load(os.path.join(results, f4b)), load(os.path.join(results, f06b))
    rows4, rows06 = merge_repeats(step_rows(d4, f4b)), merge_repeats(step_rows(d06, f06b))
    if only_4b:
        rows4 = [r for r in rows4 if r["variant"] in only_4b]
    if not (rows4 or rows06):
        note("nothing to plot for memory/speed")
        return None
    devices = {(d or {}).get("meta", {}).get("device") for d in (d4, d06)} - {None}
    device = " / ".join(sorted(devices)) or "GPU"

    fig = plt.figure(figsize=(17, 7.2))
    # columns: 4B pgs rows | 4B HF (the broken x axis) | spacer | 0.6B
    gs = fig.add_gridspec(1, 4, width_ratios=[3.2, 0.9, 0.5, 4.2], wspace=0.05, left=0.05, right=0.99,
                          top=0.825, bottom=0.09)
    panel_4b(fig, gs[0], gs[1], rows4, f4b)
    panel_06b(fig, gs[3], rows06, f06b)
    fig.suptitle(f"One-GPU SFT step on one {device}, bf16, random init: peak allocated memory vs speed "
                 f"(each panel's points from one device call: {f4b}, {f06b})\n"
                 "HF = transformers + torch AdamW; pgs release = update inside backward with lion8bit, chunked "
                 "loss; AC = activation checkpointing; varlen = attention within each packed document;\n"
                 "slabs = layer inputs offloaded to host + tied head stepped in row slabs; per-param = one "
                 "release group per parameter; tiled MLP = each MLP in token slices;\n"
                 "sublayer ckpt + offload = each layer's attention and MLP halves checkpointed apart, both "
                 "halves' inputs offloaded to host", fontsize=9.5)
    path = os.path.join(out, "sft_4b_memory_speed.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def converge_style(v: str, meta: dict):
    """variant -> (label, colour, linestyle, linewidth), the learning rates from the file's meta."""
    adam, lion = meta.get("adam_lr"), meta.get("lion_lr")
    def lr(x):
        if x is None:
            return ""
        m, e = f"{x:.0e}".split("e")  # 0.0003 -> "3e-4"
        return f" (lr {m}e{int(e)})"

    return {
        "hf_adamw": (f"HF: fp32 weights, torch AdamW{lr(adam)}", "black", "-", 2.6),
        "pgs_adamw8bit": (f"pgs: bf16 + SR, adamw8bit{lr(adam)}", "tab:orange", "--", 1.6),
        "pgs_lion8bit": (f"pgs: bf16 + SR, lion8bit{lr(lion)}", "tab:blue", "-", 1.6),
        "hf_lion8bit_bnb": (f"HF: fp32 weights, bitsandbytes Lion8bit{lr(lion)}", "tab:purple", "-.", 1.6),
    }.get(v, (v, None, "-", 1.4))


CONVERGE_ORDER = ("hf_adamw", "pgs_adamw8bit", "pgs_lion8bit", "hf_lion8bit_bnb")


def data_text(meta: dict) -> str:
    """What a convergence run trained on, from its meta (older files have no ``data``: the chain)."""
    data = meta.get("data", "markov")
    if data == "bpe":
        what = (f"the stdlib's sources through a BPE of {meta.get('tokenizer_vocab', '?')} tokens, "
                f"{meta.get('ids_used', '?')} ids used")
    elif data == "bytes":
        what = "the stdlib's sources, one token per byte"
    else:
        what = f"Markov chain over {meta.get('states', '?')} ids"
    if meta.get("warm_start"):
        other = "another chain" if data == "markov" else "other text"
        what += f"; every variant from the weights of {meta['warm_start']} HF AdamW steps on {other}"
    else:
        what += "; random init"
    return what


def plot_converge(path_in: str, out: str, name: str = "sft_converge.png") -> str | None:
    conv = load(path_in)
    if not conv:
        return None
    meta = conv.get("meta", {})
    series, rows = {}, {}
    for r in conv.get("results", []):
        if r.get("losses"):
            series[r["variant"]], rows[r["variant"]] = r["losses"], r
        else:
            note(f"converge variant {r.get('variant')} has no losses; skipped")
    if not series:
        return None
    order = [v for v in CONVERGE_ORDER if v in series] + [v for v in series if v not in CONVERGE_ORDER]
    n = max(len(s) for s in series.values())

    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw=dict(width_ratios=[2.1, 1]))
    for v in order:
        lab, col, ls, lw = converge_style(v, meta)
        r = rows[v]
        if "last10_mean" in r and "held_out_loss" in r:
            lab += f": last-10 mean {r['last10_mean']:.3f}, held-out {r['held_out_loss']:.3f}"
        ax.plot(range(len(series[v])), series[v], label=lab, color=col, ls=ls, lw=lw)
    top = 1.15 * max(s[0] for s in series.values())
    if "uniform_loss" in meta and meta["uniform_loss"] < top:
        ax.axhline(meta["uniform_loss"], color="0.4", ls=":", lw=1)
        ax.text(n - 1, meta["uniform_loss"] + 0.1,
                f"uniform over the {meta.get('states', '?')} ids: {meta['uniform_loss']:.2f}",
                ha="right", va="bottom", fontsize=8.5, color="0.3")
    if "unigram_entropy" in meta:
        ax.axhline(meta["unigram_entropy"], color="0.4", ls="--", lw=0.8)
        ax.text(n - 1, meta["unigram_entropy"] + 0.1, f"unigram entropy: {meta['unigram_entropy']:.2f}",
                ha="right", va="bottom", fontsize=8.5, color="0.3")
    if "entropy_floor" in meta:
        ax.axhline(meta["entropy_floor"], color="tab:green", ls=":", lw=1)
        ax.text(n - 1, meta["entropy_floor"] + 0.1, f"chain's entropy (floor): {meta['entropy_floor']:.2f}",
                ha="right", va="bottom", fontsize=8.5, color="tab:green")
    # a loss spike (HF AdamW's step 118 in 2026-11-30-sft-converge.json reached 25) would flatten the rest: clip the
    # axis a little above the starting loss and say so
    peak = max(max(s) for s in series.values())
    low = min(min(s) for s in series.values())
    # from 0 where a floor is drawn (the chain's entropy); else from a nat below the lowest loss
    ax.set_ylim(0 if "entropy_floor" in meta else max(0.0, int(low) - 1.0), top)
    if peak > top:
        ax.text(0.02, 0.02, f"y axis clipped: a spike reaches {peak:.1f}", transform=ax.transAxes, ha="left",
                va="bottom", fontsize=8, color="0.35")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.legend(fontsize=8.5, loc="upper right")
    ax.grid(alpha=0.3)

    if "hf_adamw" in series and len(order) > 1:
        ref = series["hf_adamw"]
        tail = []
        for v in order:
            if v == "hf_adamw":
                continue
            lab, col, ls, _ = converge_style(v, meta)
            d = [a - b for a, b in zip(series[v], ref)]
            ax_d.plot(range(len(d)), d, color=col, ls=ls, lw=1.4, label=lab.split(",")[-1].strip())
            tail.append((v, d, col, ls))
        ax_d.axhline(0, color="black", lw=0.8)
        ax_d.set_ylim(max(-3.0, min(min(d) for _, d, _, _ in tail) - 0.2), None)
        ax_d.set_xlabel("optimizer step")
        ax_d.set_ylabel("loss − HF AdamW loss (nats/token)")
        ax_d.set_title("difference from HF AdamW", fontsize=9.5)
        ax_d.legend(fontsize=8.5, loc="upper right")
        ax_d.grid(alpha=0.3)
        h = n // 2
        big = max(abs(x) for _, d, _, _ in tail for x in d) or 1.0
        if n >= 40 and max(abs(x) for _, d, _, _ in tail for x in d[h:]) < 0.1 * big:
            # a zoom on the second half, where the difference is too small to read on the main scale
            ins = ax_d.inset_axes([0.38, 0.3, 0.58, 0.36])
            for i, (v, d, col, ls) in enumerate(tail):
                ins.plot(range(h, len(d)), d[h:], color=col, ls=ls, lw=1.2)
                last = d[-10:]
                ins.text(0.97, 0.92 - 0.12 * i, f"mean of the last 10: {sum(last) / len(last):+.3f}", color=col,
                         transform=ins.transAxes, ha="right", va="top", fontsize=8)
            ins.axhline(0, color="black", lw=0.8)
            ins.set_title(f"zoom: steps {h}-{n - 1}", fontsize=8)
            ins.tick_params(labelsize=7.5)
            ins.grid(alpha=0.3)
    else:
        ax_d.set_visible(False)

    fig.suptitle(f"Convergence, Qwen3-0.6B shape on one {meta.get('device', 'GPU')}: same init, same "
                 f"{meta.get('steps', n)} batches of {meta.get('batch', '?')}×{meta.get('seq', '?')} tokens "
                 f"({os.path.relpath(path_in, os.path.dirname(os.path.dirname(path_in)))})\n{data_text(meta)};\n"
                 f"warm-up {meta.get('warmup', '?')} + cosine, all variants from one run", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- session 2's inputs (``--inputs s2``): the probe's rows and the HF baselines of the same call ----

# Readable names for the probe's row ids; an unknown id is shown as it is.
LABELS_4B_S2 = {
    "base": "before sync fix, chunk 256",
    "nosync": "sync fix, chunk 256",
    "nosync_kadd_c1024": "pgs now: chunk 1024",
    "nosync_kadd_c2048": "chunk 2048",
    "nosync_c1024_nodefer": "head grad not deferred",
    "noupdate_c1024": "no update (floor, not training)",
    "offload_nosync_kadd_c256": "offload, chunk 256",
    "offload_nosync_kadd_c1024": "offload, chunk 1024",
    "offload_pergroup_nosync_kadd_c256": "offload, group per param",
}
LABELS_06B_S2 = {
    "ac_base": "full AC, before sync fix",
    "ac_nosync_kadd": "full AC",
    "noac_base": "no AC, before sync fix",
    "noac_nosync_kadd": "pgs now: no AC",
}
HF_LABELS_S2 = {
    "hf_compiled_ac": "HF: compiled layers\n+ AC + AdamW",
    "hf_liger": "HF: Liger, no AC, AdamW",
}

def timed_rows_s2(probe, shape: str) -> list[dict]:
    """The probe's timed variants at ``shape`` (rows with tok_s and peak_gib), in file order."""
    if not probe:
        return []
    out = []
    for r in probe.get("rows", []):
        if r.get("shape") != shape or "row" not in r:
            continue
        if "tok_s" in r and "peak_gib" in r:
            out.append(r)
        elif "profile" not in r and "syncs" not in r and r.get("row") != "dynamo_counters":
            note(f"probe row {shape}/{r.get('row')} has no tok_s/peak_gib; skipped")
    if not out:
        note(f"no timed probe rows for {shape}")
    return out


def hf_row_s2(hf, shape: str):
    if not hf:
        return None
    for r in hf.get("results", []):
        if r.get("shape") == shape and "tok_s" in r and "peak_gib" in r:
            return r
    note(f"no HF row for {shape}")
    return None


def point_style_s2(name: str) -> dict:
    if name.startswith("noupdate"):  # a bound, not a training step
        return dict(marker="o", facecolor="none", edgecolor="gray", s=60)
    if name in ("nosync_kadd_c1024", "noac_nosync_kadd"):
        return dict(marker="*", color="tab:red", s=240, zorder=5)
    if "offload" in name:
        return dict(marker="D", color="tab:green", s=50)
    if name.endswith("base"):
        return dict(marker="v", color="tab:purple", s=60)
    return dict(marker="o", color="tab:blue", s=60)


def label_s2(ax, x, y, text, pos=None, ha="left"):
    """Label point (x, y); ``pos`` is the text's place in data units (None: just right of it)."""
    box = dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8)
    if pos is None:
        ax.annotate(text, (x, y), xytext=(8, 0), textcoords="offset points", fontsize=8, ha="left",
                    va="center", bbox=box)
    else:
        ax.annotate(text, (x, y), xytext=pos, textcoords="data", fontsize=8, ha=ha, va="center", bbox=box,
                    arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0, shrinkB=4))


# Where the known rows' labels go (data units: GiB, tok/s; and the alignment), so the close
# points' labels do not overlap. A row not listed here is labelled just right of its point.
LABEL_AT_S2 = {
    "noupdate_c1024": (12.80, 14950, "left"), "nosync_c1024_nodefer": (13.45, 14300, "center"),
    "nosync_kadd_c1024": (12.62, 13950, "right"), "nosync_kadd_c2048": (12.95, 13000, "left"),
    "nosync": (12.90, 12350, "left"), "base": (12.85, 10539, "left"),
    "offload_nosync_kadd_c256": (11.62, 12950, "left"), "offload_nosync_kadd_c1024": (12.38, 10900, "right"),
    "offload_pergroup_nosync_kadd_c256": (12.35, 7507, "left"),
    "ac_base": (8, 35284, "left"), "ac_nosync_kadd": (8, 42179, "left"),
    "noac_base": (49, 41452, "right"), "noac_nosync_kadd": (46, 56500, "right"),
}


def place_s2(ax, r, text):
    at = LABEL_AT_S2.get(r["row"])
    if at is None:
        label_s2(ax, r["peak_gib"], r["tok_s"], text)
    else:
        label_s2(ax, r["peak_gib"], r["tok_s"], text, at[:2], at[2])


def plot_memory_speed_s2(results: str, out: str) -> str | None:
    probe = load(os.path.join(results, "2026-11-29-probe-sft-step-variants.json"))
    hf4 = hf_row_s2(load(os.path.join(results, "2026-11-29-sft-step-4b-hf-final.json")), "qwen3-4b")
    hf06 = hf_row_s2(load(os.path.join(results, "2026-11-29-sft-step-06b-hf-final.json")), "qwen3-0.6b")
    rows4, rows06 = timed_rows_s2(probe, "qwen3-4b"), timed_rows_s2(probe, "qwen3-0.6b")
    if not (rows4 or rows06 or hf4 or hf06):
        note("nothing to plot for memory/speed")
        return None
    device = (probe or {}).get("meta", {}).get("device", "GPU")

    fig = plt.figure(figsize=(14, 5.6))
    # columns: 4B pgs rows | 4B HF (the broken x axis) | spacer | 0.6B
    gs = fig.add_gridspec(1, 4, width_ratios=[3.2, 0.9, 0.45, 3.2], wspace=0.05, left=0.06, right=0.985,
                          top=0.83, bottom=0.11)
    ax_a, ax_b = fig.add_subplot(gs[0]), None
    ax_c = fig.add_subplot(gs[3])

    # --- Qwen3-4B, 1x4096: a broken x axis (pgs near 12-14 GiB, HF near 31-32 GiB) ---
    ys = [r["tok_s"] for r in rows4] + ([hf4["tok_s"]] if hf4 else [])
    if ys:
        xs_pgs = [r["peak_gib"] for r in rows4] + [GOAL_GIB_4B]
        ax_a.set_xlim(min(xs_pgs) - 0.45, max(xs_pgs) + 0.53)
        # not from 0: the rows sit between ~7.5k and ~14.5k tok/s and their labels need the room
        ax_a.set_ylim(min(ys) * 0.85, max(ys) * 1.07)
        for r in rows4:
            ax_a.scatter(r["peak_gib"], r["tok_s"], **point_style_s2(r["row"]))
            place_s2(ax_a, r, f"{LABELS_4B_S2.get(r['row'], r['row'])}  {r['tok_s']:,.0f}")
        ax_a.axvline(GOAL_GIB_4B, color="tab:red", ls=":", lw=1.4)
        ax_a.text(GOAL_GIB_4B - 0.02, min(ys) * 0.87, "12 GiB goal", color="tab:red", rotation=90,
                  ha="right", va="bottom", fontsize=8)
        ax_a.set_ylabel("throughput (tokens/s, higher is better)")
        ax_a.set_title("Qwen3-4B, 1×4096, full weights trainable", fontsize=10, loc="left")
        ax_a.grid(alpha=0.3)
        if hf4:
            ax_b = fig.add_subplot(gs[1], sharey=ax_a)
            ax_b.scatter(hf4["peak_gib"], hf4["tok_s"], marker="s", color="black", s=70, zorder=5)
            ax_b.set_xlim(hf4["peak_gib"] - 0.8, hf4["peak_gib"] + 0.8)
            ax_b.annotate(f"{HF_LABELS_S2.get(hf4['variant'], hf4['variant'])}\n"
                          f"{hf4['tok_s']:,.0f} tok/s\n{hf4['peak_gib']:.2f} GiB",
                          (hf4["peak_gib"], hf4["tok_s"]), xytext=(0, -40), textcoords="offset points",
                          fontsize=8, ha="center", va="top",
                          arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6))
            for ax in (ax_a, ax_b):
                ax.axhline(hf4["tok_s"], color="black", ls="--", lw=1)
            ax_b.text(hf4["peak_gib"], hf4["tok_s"] * 1.012, "HF tok/s\n(same call)", fontsize=8,
                      va="bottom", ha="center")
            ax_b.tick_params(axis="y", left=False, labelleft=False)
            ax_b.grid(alpha=0.3)
            break_marks(fig, ax_a, ax_b)  # between the two halves of the x axis
            fig.text((ax_a.get_position().x0 + ax_b.get_position().x1) / 2, 0.02,
                     "peak allocated memory (GiB; x axis broken between the pgs rows and HF)",
                     ha="center", fontsize=9)
        else:
            note("4B HF baseline missing: no HF line in the 4B panel")
            ax_a.set_xlabel("peak allocated memory (GiB)")
    else:
        ax_a.text(0.5, 0.5, "no 4B rows", ha="center", transform=ax_a.transAxes)

    # --- Qwen3-0.6B, 8x4096 packed ---
    pts = [(r["peak_gib"], r["tok_s"]) for r in rows06] + ([(hf06["peak_gib"], hf06["tok_s"])] if hf06 else [])
    if pts:
        top = max(y for _, y in pts) * (GOAL_SPEEDUP_06B * 1.08 if hf06 else 1.12)
        ax_c.set_xlim(0, max(x for x, _ in pts) * 1.1)
        ax_c.set_ylim(0, max(top, max(y for _, y in pts) * 1.12))
        for r in rows06:
            ax_c.scatter(r["peak_gib"], r["tok_s"], **point_style_s2(r["row"]))
            place_s2(ax_c, r, f"{LABELS_06B_S2.get(r['row'], r['row'])}  {r['tok_s']:,.0f}")
        if hf06:
            ax_c.scatter(hf06["peak_gib"], hf06["tok_s"], marker="s", color="black", s=70, zorder=5)
            label_s2(ax_c, hf06["peak_gib"], hf06["tok_s"],
                  f"{HF_LABELS_S2.get(hf06['variant'], hf06['variant'])}  {hf06['tok_s']:,.0f}",
                  (hf06["peak_gib"] - 3, hf06["tok_s"] * 0.93), "right")
            ax_c.axhline(hf06["tok_s"], color="black", ls="--", lw=1)
            ax_c.text(0.5, hf06["tok_s"] * 1.01, "HF tok/s (same call)", fontsize=8, va="bottom")
            goal = hf06["tok_s"] * GOAL_SPEEDUP_06B
            ax_c.axhline(goal, color="tab:red", ls=":", lw=1.4)
            ax_c.text(0.5, goal * 1.01, f"goal: {GOAL_SPEEDUP_06B}× HF tok/s", color="tab:red",
                      fontsize=8, va="bottom")
        else:
            note("0.6B HF baseline missing: no HF line in the 0.6B panel")
        ax_c.set_xlabel("peak allocated memory (GiB)")
        ax_c.set_ylabel("throughput (tokens/s)")
        ax_c.set_title("Qwen3-0.6B, 8×4096 packed", fontsize=10, loc="left")
        ax_c.grid(alpha=0.3)
    else:
        ax_c.text(0.5, 0.5, "no 0.6B rows", ha="center", transform=ax_c.transAxes)

    fig.suptitle(f"One-GPU SFT step on one {device}, bf16, random init: memory vs speed\n"
                 "HF and pgs points of a panel come from the same device call; pgs = gradient release + "
                 "lion8bit (★ = pgs now, ▼ = before the sync fix, ◆ = layer inputs offloaded)",
                 fontsize=10)
    path = os.path.join(out, "sft_4b_memory_speed.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--inputs", choices=("latest", "s2"), default="latest",
                    help="which result files (default: the latest calls; s2: the session-2 probe and converge runs)")
    ap.add_argument("--sft-4b", default=LATEST_FILES["sft_4b"], help="4B bench/sft_step.py JSON (with --inputs latest)")
    ap.add_argument("--sft-06b", default=LATEST_FILES["sft_06b"], help="0.6B bench/sft_step.py JSON (with --inputs latest)")
    ap.add_argument("--only-4b", default="", help="comma-separated variants of the 4B file to draw (default: all)")
    ap.add_argument("--converge", default=None,
                    help="one bench/sft_converge.py JSON drawn as sft_converge.png (default: the three of "
                         "LATEST_CONVERGE, or 2026-11-29-sft-converge.json with --inputs s2)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.inputs == "s2":
        mem = plot_memory_speed_s2(args.results, args.out)
        convs = [(args.converge or "2026-11-29-sft-converge.json", "sft_converge.png")]
    else:
        mem = plot_memory_speed(args.results, args.out, args.sft_4b, args.sft_06b,
                                [v for v in args.only_4b.split(",") if v] or None)
        convs = [(args.converge, "sft_converge.png")] if args.converge else list(LATEST_CONVERGE)
    wrote = [p for p in [mem] + [plot_converge(os.path.join(args.results, f), args.out, png) for f, png in convs] if p]
    for p in wrote:
        print(f"wrote {os.path.relpath(p)} ({os.path.getsize(p) / 1024:.0f} KiB)")
    return 0 if wrote else 1


if __name__ == "__main__":
    sys.exit(main())
