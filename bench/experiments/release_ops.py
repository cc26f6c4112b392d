"""Aten ops (and how many of them launch a kernel on a GPU) per decoder-layer group step of
gradient release, on the CPU (issue #8: the memory-lean 4B runs are host-bound inside the
release hooks, so every launch and every dispatcher call of a group step is speed).

A tiny Qwen3 (2 layers, the 4B's leaf structure: 7 weights in 8 bits, 4 norm weights with fp32
state) steps with ``GradientRelease(pf.lion8bit / pf.adamw8bit(backend="triton"),
stochastic_rounding=True)`` under ``TRITON_INTERPRET=1``; a ``TorchDispatchMode`` counts the
aten ops of each group step, Triton kernels (and the ops inside the interpreter) counted apart.
"launching" leaves out the ops that never launch a kernel (views, splits, detach, empty
allocations, dtype queries): ``HOST_ONLY``.  A ``torch._foreach_*`` op counts once: one
multi-tensor launch when its lists share dtype and device (``_foreach_norm``: two kernels).

    python bench/experiments/release_ops.py            # this checkout, with the numbers before
    python bench/experiments/release_ops.py /path/pkg  # another checkout's pgs (e.g. git archive)
    python bench/experiments/release_ops.py [/path/pkg] --host-time   # CPU time per layer group

``--host-time``: the Triton launchers stubbed out (no kernel runs; the small-leaf one too), an 8-layer model, one
thread; the process time of each layer group's step (median over 25 backwards).  At 09aeee2
~290 µs (lion8bit) and ~370 µs (adamw8bit); after the multi-tensor cuts ~215 and ~280; with the
small-leaf kernel Lion ~185 (a shared 2-core machine: ±10%, more when other jobs run).

Per layer group, SR on (aten ops / launching ops; 7 Triton kernels at 09aeee2):

    chain      grad norm   09aeee2       multi-tensor cuts   + small-leaf kernel (now)
    lion8bit   off         134 / 54      62 / 14             40 / 3, 8 Triton kernels
    lion8bit   on          168 / 88      63 / 15             41 / 4, 8 Triton kernels
    adamw8bit  off         186 / 79      94 / 28             (unchanged: Lion only)
    adamw8bit  on          220 / 113     95 / 29

The counting pieces (``HOST_ONLY``, the dispatch mode, the group-step harness) are the ones
``tests/test_release_launches.py`` bounds the counts with.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
_ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
if _ARGS:
    sys.path.insert(0, _ARGS[0])

import torch  # noqa: E402

import pgs.func as pf  # noqa: E402
from pgs.runtime.optim.release import GradientRelease  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from test_release_launches import HOST_ONLY, counting_run, launching  # noqa: E402
from test_release_launches import group_step_ops as _group_step_ops  # noqa: E402

#: numbers measured at 09aeee2 (before the cuts): (aten ops, launching ops) per layer group
BEFORE = {("lion8bit", False): (134, 54), ("lion8bit", True): (168, 88),
          ("adamw8bit", False): (186, 79), ("adamw8bit", True): (220, 113)}


def _patch_interpreter():
    """Counts Triton kernel runs by name; returns (counter, pause flag)."""
    import triton.runtime.interpreter as TI

    run = TI.InterpretedFunction.run
    if getattr(run, "_pgs_counting", False):
        return run._pgs_counting
    counted, kernels, paused = counting_run(run)
    counted._pgs_counting = (kernels, paused)
    TI.InterpretedFunction.run = counted
    return kernels, paused


def tiny_qwen3(layers: int = 2, hidden: int = 128):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def group_step_ops(chain, *, track_grad_norm: bool, layers: int = 2, hidden: int = 128,
                   stochastic_rounding: bool = True) -> dict:
    """``{group: (aten op Counter, Triton kernel Counter)}`` of the second backward's group steps."""
    rel, out = _group_step_ops(tiny_qwen3(layers, hidden), chain, _patch_interpreter(),
                               track_grad_norm=track_grad_norm, stochastic_rounding=stochastic_rounding)
    if track_grad_norm:
        rel.metrics()
    return out


def host_time(opt: str, track_grad_norm: bool = True, layers: int = 8, backwards: int = 30) -> float:
    """Median process time (µs) of a layer group's step, the Triton launchers stubbed out."""
    import time

    from pgs.func import kernels as K

    def lion(g, m, hp, bs, *, p=None, out=None, m_out=None, seed=None):
        return out, (m_out if m_out is not None else m)

    def adam(g, m, v, hp, bs, *, p=None, out=None, m_out=None, v_out=None, seed=None):
        return out, (m_out if m_out is not None else m), (v_out if v_out is not None else v)

    from pgs.func.kernels import small as KS

    saved = K._lion8bit, K._adam8bit, KS.lion_small_
    K._lion8bit, K._adam8bit, KS.lion_small_ = lion, adam, lambda *a, **k: None
    torch.set_num_threads(1)
    try:
        model = tiny_qwen3(layers)
        chain = pf.lion8bit(1e-5, backend="triton") if opt == "lion8bit" else pf.adamw8bit(1e-5, backend="triton")
        rel = GradientRelease(chain, model, stochastic_rounding=True, track_grad_norm=track_grad_norm)
        step, times = rel._step_group, []

        def timed(group):
            if ".layers." in group:
                t = time.process_time_ns()
                step(group)
                times.append(time.process_time_ns() - t)
            else:
                step(group)

        rel._arrivals.on_complete = timed
        x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(backwards):
            model(x, labels=x, use_cache=False).loss.backward()
            if track_grad_norm:
                rel.metrics()
        times = sorted(times[5 * layers:])
        return times[len(times) // 2] / 1e3
    finally:
        K._lion8bit, K._adam8bit, KS.lion_small_ = saved


def main():
    if "--host-time" in sys.argv:
        for name in ("lion8bit", "adamw8bit"):
            print(f"{name:10} grad norm on: {host_time(name):.0f} us per layer group step (CPU, kernels stubbed)")
        return
    print(f"torch {torch.__version__}; pgs from {os.path.dirname(pf.__file__)}")
    print(f"{'chain':10} {'grad norm':9} {'aten ops':>14} {'launching':>14} {'triton':>6}"
          "   (per layer group: before -> now)")
    for name, make in (("lion8bit", lambda: pf.lion8bit(1e-5, backend="triton")),
                       ("adamw8bit", lambda: pf.adamw8bit(1e-5, backend="triton"))):
        for tgn in (False, True):
            res = group_step_ops(make(), track_grad_norm=tgn)
            ops, kern = res["model.layers.0"]
            b_all, b_launch = BEFORE[(name, tgn)]
            print(f"{name:10} {str(tgn):9} {b_all:>6} -> {sum(ops.values()):<4} {b_launch:>6} -> {launching(ops):<4}"
                  f" {sum(kern.values()):>6}")
            if tgn:
                top = {k: v for k, v in ops.most_common() if k not in HOST_ONLY}
                print(f"{'':21}launching: {top}")


if __name__ == "__main__":
    main()
