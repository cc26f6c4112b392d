"""``pgs prepare SPEC --out DIR``: what the command does, given its parsed arguments (docs/prepare.md).

Scoring runs unless only ``--order`` or ``--self-answer`` is asked for; ``--select`` reads the
scores (scoring what is missing first).  Files under ``DIR``:

* ``scores.jsonl``, ``scores.meta.json``, ``report/`` (histograms, ``summary.md``);
* ``selected.jsonl`` and ``random.jsonl`` (the random baseline of the same size),
  ``selection.json``;
* ``ordered.jsonl`` (``--order tfp``);
* ``self_answers.jsonl``, ``dataset_answers.jsonl`` (the same prompts with the data's answers),
  ``self_answers.json`` (``--self-answer``).
"""

from __future__ import annotations

import json
import os

from pgs.errors import SpecError


def prepare(spec, args, log=print) -> int:
    from pgs.runtime.prepare import score as S

    out = args.out
    os.makedirs(out, exist_ok=True)
    device = S.device_for(spec.train.device)
    wants_score = bool(args.select) or not (args.order or args.self_answer)
    held = {}

    def model():
        if not held:
            held["model"], held["tokenizer"] = S.load_model(spec, device)
        return held["model"], held["tokenizer"]

    if wants_score:
        m, t = model()
        counts = S.score(spec, out, batch_size=args.batch_size, device=device, model=m, tokenizer=t, log=log)
        log(f"scored {counts['scored']} samples ({counts['resumed']} already scored) into "
            f"{os.path.join(out, S.SCORES)}")
        scores = S.read_scores(os.path.join(out, S.SCORES))
        from pgs.runtime.prepare.report import write_score_report

        write_score_report(scores, out, title=out)
        if args.select:
            _select(spec, args, scores, log)
    if args.order:
        _order(spec, args, device, model, log)
    if args.self_answer:
        _self_answer(spec, args, model, log)
    return 0


def _select(spec, args, scores, log) -> None:
    from pgs.runtime.prepare import select as sel

    seed = spec.data.seed if args.seed is None else args.seed
    result = sel.select(scores, args.select, size=args.size, fraction=args.fraction, seed=seed,
                        outlier_z=args.outlier_z)
    selected = os.path.join(args.out, "selected.jsonl")
    baseline = os.path.join(args.out, "random.jsonl")
    sel.write_selection(spec, result["selected"], selected)
    sel.write_selection(spec, result["random"], baseline)
    sel.write_summary(result, os.path.join(args.out, "selection.json"))
    dropped = result["dropped_outliers"]
    log(f"selected {len(result['selected'])} of {result['scored']} scored samples by {args.select!r} "
        f"(outliers dropped: {dropped['length']} by length, {dropped['nll']} by NLL) into {selected}; "
        f"the random baseline of the same size: {baseline}")


def _order(spec, args, device, model, log) -> None:
    if args.order != "tfp":
        raise SpecError(f"--order: {args.order!r} is not 'tfp'")
    from pgs.runtime.prepare.order import write_tfp

    m, t = model()
    path = os.path.join(args.out, "ordered.jsonl")
    n = write_tfp(spec, m, t, device, path, threshold=args.tfp_threshold, window=args.tfp_window,
                  batch_size=args.batch_size)
    log(f"wrote {n} samples in TFP order to {path} (pgs run shuffles and isolates packed documents, "
        "so this order only helps a trainer that packs in file order: docs/prepare.md)")


def _self_answer(spec, args, model, log) -> None:
    from pgs.runtime.prepare import self_answer as sa
    from pgs.runtime.prepare.verify import make_verifier

    if not args.verify:
        raise SpecError("--self-answer: --verify is needed (exact, number, regex:PATTERN, json, tool_call "
                        "or module:function)")
    verify = make_verifier(args.verify)
    seed = spec.data.seed if args.seed is None else args.seed
    m, t = model()
    options = dict(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                   seed=seed, batch_size=args.batch_size)
    records, originals, stats = [], [], {}
    left = args.limit
    for source in spec.data.sources:
        if left is not None and left <= 0:
            break
        chunk = sa.read_records(source.path, left)
        left = None if left is None else left - len(chunk)
        kept, dataset, counts = sa.self_answer(m, t, chunk, verify, k=args.k, format=source.format,
                                               fields=source.fields(), **options)
        records += kept
        originals += dataset
        for key, value in counts.items():
            stats[key] = stats.get(key, 0) + value
    if args.replay:
        general = sa.read_records(args.replay)
        n = sa.replay_count(len(records), args.replay_share)
        replayed, counts = sa.replay(m, t, general, n, **options)
        records += replayed
        stats.update(counts)
    path = os.path.join(args.out, "self_answers.jsonl")
    sa.write_jsonl(path, records)
    sa.write_jsonl(os.path.join(args.out, "dataset_answers.jsonl"), originals)
    stats.update(verify=args.verify, k=args.k, temperature=args.temperature, top_p=args.top_p, written=len(records))
    with open(os.path.join(args.out, "self_answers.json"), "w", encoding="utf-8") as handle:
        json.dump(stats, handle, indent=1)
    log(f"self-answers: {stats.get('kept', 0)} of {stats.get('prompts', 0)} prompts have an accepted answer "
        f"({stats.get('accepted', 0)} of {stats.get('answers', 0)} answers accepted by {args.verify!r})"
        + (f", {stats.get('replay_kept', 0)} replayed" if args.replay else "") + f"; wrote {len(records)} to {path}")
