"""Per-source eval loss, and mSFT: drop the earliest-overfitting source, revert to its best step.

A source with its own eval file (``data.sources = [{ path = "a.jsonl", eval = "a_eval.jsonl" }]``)
gets ``eval_loss_<name>`` at every evaluation (:func:`source_eval_losses`; ``<name>`` is the
file's stem, or ``source<i>`` when stems repeat).

``data.msft_round = C`` (steps, 0: off) runs mSFT (Koh et al., arXiv 2603.21606;
docs/techniques/msft.md) over the sources, all of which then need an eval file:

    active = all sources
    repeat: train on the mix of the active sources for C steps, evaluating each active source
            every train.eval_every steps and keeping a snapshot of the weights and optimizer
            state at each source's best step so far;
            τ_i = the step of source i's lowest eval loss in this round;
            i* = argmin_i τ_i (the earliest to overfit; ties: the first source);
            remove i* from the mix; weights and optimizer state ← the snapshot at τ_{i*}
    until no source is active (the run then ends, with the last source's best weights).

The round ends at the first evaluation at or after C steps since it began.  The step counter
keeps counting through a revert (the steps after τ_{i*} were spent), so the schedule goes on
where it was.  The paper's overfitting metric was not recovered; the eval loss of each
source is used.  Snapshots are checkpoint folders under ``<run dir>/msft/`` (only those some
active source's best still needs are kept), and the state (active sources, round, bests) is
part of every checkpoint, so a resumed run continues the same rounds.

Several processes (FSDP2): each source's eval loss is evaluated by every rank on its share of
the eval batches and the sums are all-reduced (``sharded_eval_loss``); the losses every
decision reads are then rank 0's, broadcast, so every rank excludes the same source at the
same step.  Snapshots are sharded (DCP) folders written and read by every rank; the revert
loads weights and optimizer state only (the RNG goes on, as on one process); the new mix is
read by each rank for its share.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import attrs

from pgs.errors import CheckpointError


def source_names(sources) -> list[str]:
    """A metric name per source: its file's stem, or ``source<i>`` for all when stems repeat."""
    stems = [Path(s.path).stem.replace("-", "_").replace(".", "_") for s in sources]
    return stems if len(set(stems)) == len(stems) else [f"source{i}" for i in range(len(sources))]


def source_eval_losses(run, indices=None) -> dict[str, float]:
    """``{"eval_loss_<name>": loss}`` of each source (of ``indices``) that has an eval file
    (several processes: every rank, the same numbers)."""
    from pgs.runtime.data import EvalStream
    from pgs.runtime.loop.evaluate import eval_loss, sharded_eval_loss

    spec = run.spec
    sources = spec.data.sources
    names = source_names(sources)
    out = {}
    for i, source in enumerate(sources):
        if source.eval is None or (indices is not None and i not in indices):
            continue
        if run.ctx is not None:
            loss = sharded_eval_loss(run, source.eval)
        else:
            batches = EvalStream(spec.data, run.tokenizer, max(1, run.micro_batch), path=source.eval)
            loss = eval_loss(run.model, batches, backend="chunked", chunk_size=spec.loss.chunk_size)
        out[f"eval_loss_{names[i]}"] = loss["eval_loss"]
    return out


def pick_excluded(best: dict[int, tuple[int, float]]) -> int:
    """i* = argmin_i τ_i: the source whose best step came first (ties: the lowest index)."""
    return min(best, key=lambda i: (best[i][0], i))


@attrs.define
class Msft:
    """The mSFT rounds of one run (module docstring)."""

    round_steps: int
    active: list[int]
    names: list[str]
    root: str
    round_start: int = 0
    best: dict[int, tuple[int, float]] = attrs.field(factory=dict)  # source -> (step, loss) this round
    history: dict[int, dict[str, float]] = attrs.field(factory=dict)  # step -> source -> loss, this round
    excluded: list[dict] = attrs.field(factory=list)
    finished: bool = False

    @classmethod
    def create(cls, spec) -> "Msft | None":
        c = spec.data.msft_round  # its fields are checked with the spec (spec/load.py)
        if not c:
            return None
        return cls(round_steps=c, active=list(range(len(spec.data.sources))),
                   names=source_names(spec.data.sources), root=os.path.join(spec.checkpoint.dir, "msft"))

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"active": list(self.active), "round_start": self.round_start,
                "best": {str(i): list(v) for i, v in self.best.items()}, "excluded": list(self.excluded),
                "history": {str(k): v for k, v in self.history.items()},
                "finished": self.finished}

    def load_state_dict(self, run, state: dict) -> None:
        """Restore the rounds; the training mix is rebuilt with the active sources (before the
        data position is restored, which must come from that mix)."""
        self.active = [int(i) for i in state["active"]]
        self.round_start = int(state["round_start"])
        self.best = {int(i): (int(v[0]), float(v[1])) for i, v in state["best"].items()}
        self.excluded = list(state["excluded"])
        self.history = {int(k): dict(v) for k, v in state["history"].items()}
        self.finished = bool(state["finished"])
        if len(self.active) < len(run.spec.data.sources) and self.active:
            swap_sources(run, self.active)

    # -- the algorithm ---------------------------------------------------------------------
    def after_eval(self, run, result: dict) -> dict | None:
        """Record this evaluation; at a round's end exclude i* and revert.  Returns the event, if any."""
        if self.finished or not self.active:
            return None
        if run.ctx is not None:  # one set of numbers decides on every rank: rank 0's
            from pgs.runtime.dist.fsdp import broadcast_object

            result = broadcast_object({k: v for k, v in result.items() if k.startswith("eval_loss_")})
        losses = {}
        for i in self.active:
            loss = result.get(f"eval_loss_{self.names[i]}")
            if loss is None:
                continue
            losses[self.names[i]] = float(loss)
            if i not in self.best or loss < self.best[i][1]:
                self.best[i] = (run.step, float(loss))
        self.history[run.step] = losses
        if any(step == run.step for step, _ in self.best.values()):
            self._snapshot(run)
        self._purge(run)
        if run.step - self.round_start < self.round_steps or not self.best:
            return None
        out = pick_excluded({i: self.best[i] for i in self.active if i in self.best})
        tau = self.best[out][0]
        if tau != run.step:
            self._revert(run, tau)
        self.active.remove(out)
        event = {"step": run.step, "event": "msft_exclude", "source": self.names[out], "best_step": tau,
                 "best_loss": self.best[out][1], "active": [self.names[i] for i in self.active]}
        self.excluded.append({k: event[k] for k in ("step", "source", "best_step", "best_loss")})
        self.round_start = run.step
        # the reverted weights are where the next round starts: each remaining source's loss there
        # is its loss at τ_{i*} when it was evaluated then, kept as its best so far
        at_tau = self.history.get(tau, {})
        self.best = {i: (run.step, at_tau[self.names[i]]) for i in self.active if self.names[i] in at_tau}
        self.history = {run.step: {self.names[i]: at_tau[self.names[i]] for i in self.best}}
        if self.best:
            self._snapshot(run)
        self._purge(run)
        if not self.active:
            self.finished = True
            run.total_steps = run.step  # the loop ends here, with the last source's best weights
        else:
            swap_sources(run, self.active)
        return event

    def _folder(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")  # the name ckpt.save gives it

    def _snapshot(self, run) -> None:
        from pgs.runtime.store import checkpoint as ckpt, dcp

        if run.ctx is not None:  # every rank writes its shards; the folder is replaced when published
            dcp.save(self.root, run.step, model=run.model, optimizer=run.bound, trainer={"msft_snapshot": True},
                     spec_toml=run.spec.to_toml(), generators=run.objective.generators())
            return
        os.makedirs(self.root, exist_ok=True)
        if os.path.isdir(self._folder(run.step)):
            shutil.rmtree(self._folder(run.step))
        ckpt.save(self.root, run.step, model=run.model, optimizer_state=run.bound.state_dict(copy=False),
                  rng=ckpt.capture_rng(generators=run.objective.generators()), trainer={"msft_snapshot": True},
                  spec_toml=run.spec.to_toml())

    def _purge(self, run) -> None:
        if (run.ctx is not None and not run.ctx.is_main) or not os.path.isdir(self.root):
            return
        needed = {self._folder(step) for step, _ in self.best.values()}
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if os.path.isdir(path) and path not in needed:
                shutil.rmtree(path, ignore_errors=True)

    def _revert(self, run, step: int) -> None:
        from pgs.runtime.store import checkpoint as ckpt, dcp

        folder = self._folder(step)
        if run.ctx is not None:
            from pgs.runtime.dist.fsdp import barrier, broadcast_object, reshard

            present = broadcast_object(os.path.isdir(folder))
        else:
            present = os.path.isdir(folder)
        if not present:
            raise CheckpointError(f"{folder}: the mSFT snapshot of step {step} is gone (removed after the "
                                  "checkpoint this run resumed from); restart the run without --resume")
        if run.ctx is not None:
            reshard(run.model)  # the eval forward left the root gathered: the next forward gathers the loaded shards
            dcp.load(folder, model=run.model, optimizer=run.bound, rng=False)
            barrier()  # every rank has read the snapshot before rank 0's _purge may remove it
            return
        saved = ckpt.load(folder)
        ckpt.load_model_state(run.model, saved.model, saved.trainer.get("aliases", {}))
        run.bound.load_state_dict(saved.optimizer)


def swap_sources(run, active: list[int]) -> None:
    """Train on the mix of the ``active`` sources from here on: a fresh stream and loader."""
    from pgs.runtime.data import TrainStream
    from pgs.runtime.data.loader import StepLoader
    from pgs.runtime.loop.objective_common import rank_and_world

    data = attrs.evolve(run.spec.data, sources=tuple(run.spec.data.sources[i] for i in active), msft_round=0)
    rank, world = rank_and_world(run.ctx, run.spec.parallel.context)  # this rank's share of the new mix
    run.loader.close()
    run.loader = StepLoader(TrainStream(data, run.tokenizer, rank=rank, world_size=world), run.micro_batch,
                            run.spec.train.grad_accum, run.device)
