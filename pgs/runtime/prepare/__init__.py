"""``pgs prepare``: score, select, order and self-answer training data with the model you will train.

* ``score``: per-sample familiarity (mean NLL), mean entropy, HES and length, on exactly the
  tokens training will use; resumable JSONL (``scores.jsonl``).
* ``select``: subsets of the scored samples (random baseline, J-shaped difficulty mix, top
  HES, outlier drop) written as JSONL sources a spec can train on.
* ``verify`` / ``self_answer``: the model's own answers to the data's prompts, kept where a
  verifier accepts them.
* ``order``: Threshold Filtering Packing order (a standalone utility).
* ``report``: histograms and a summary table of the scores.

docs/prepare.md says what each does, with the papers; ``pgs.runtime.tools.prepare`` runs them
for the CLI.
"""
