"""Objectives reachable from a spec (issue 24, item 6): CADFT gets a sample id per token from
the packed batch and trains from a spec; SymNoise is ``loss.symnoise_alpha``; InfoSFT's
reference mode (log-probs of a frozen model per token, which the loop does not compute) is
refused by ``pgs validate`` with one line."""

from __future__ import annotations

import json

import pytest
import torch

from pgs.cli import main
from pgs.func.losses import CADFT, token_loss
from pgs.runtime.data import Document, collate
from pgs.runtime.documents import document_ids
from pgs.runtime.loop import train
from pgs.runtime.spec.load import load_spec
from helpers import tiny_spec


def _doc(n: int, seed: int) -> Document:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (n,), generator=g).tolist()
    return Document(tuple(ids), tuple([False] + [True] * (n - 1)))


def test_doc_ids_follow_the_packers_documents():
    batch = collate([[_doc(3, 0), _doc(4, 1)], [_doc(5, 2)]], pad_id=0, seq_len=8)
    assert document_ids(batch.position_ids).tolist() == [[1, 1, 1, 2, 2, 2, 2, 3],  # two docs, then padding
                                                    [4, 4, 4, 4, 4, 5, 5, 5]]  # one doc, then padding


def test_cadft_on_a_packed_row_equals_each_document_alone():
    """The compatibility c_s is per sample: packing two samples in one row (ids from the
    packer) gives the loss and gradient of the two samples as rows of their own."""
    torch.manual_seed(0)
    docs = [_doc(6, 3), _doc(5, 4)]
    packed = collate([docs], pad_id=0, seq_len=12)
    alone = collate([[docs[0]], [docs[1]]], pad_id=0, seq_len=6)
    W = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    table = torch.randn(40, 8, dtype=torch.float64)
    objective = CADFT(temperature=2.0)

    def loss(batch):
        h = table[batch.input_ids]
        out = token_loss(h, W, batch.labels, objective=objective, doc_ids=document_ids(batch.position_ids))
        (grad,) = torch.autograd.grad(out.loss_sum, W)
        return out.loss_sum.detach(), grad

    (a, ga), (b, gb) = loss(packed), loss(alone)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)
    # and the row as one sample would weigh its tokens differently: the ids matter
    h = table[packed.input_ids]
    one = token_loss(h, W, packed.labels, objective=objective, doc_ids=torch.zeros(1, 12, dtype=torch.long))
    assert not torch.allclose(one.loss_sum.detach(), a)


def _train(tmp_path, *sets: str, name: str = "run") -> list[dict]:
    spec = load_spec(tiny_spec(tmp_path, name, steps=3), ["train.log_every=1", *sets])
    assert train.run(spec) == 0
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_cadft_trains_from_a_spec(tmp_path):
    steps = _train(tmp_path, 'loss.objective="cadft"', "loss.args={ temperature = 2.0 }")
    assert len(steps) == 3 and all(r["loss"] == r["loss"] and r["skipped"] == 0 for r in steps)


def test_symnoise_trains_from_a_spec_and_is_not_neftune(tmp_path, monkeypatch):
    import pgs.func.losses as losses

    calls = []
    real = losses.symnoise
    monkeypatch.setattr(losses, "symnoise", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    sym = _train(tmp_path, "loss.symnoise_alpha=5.0", name="sym")
    assert calls and set(calls) == {5.0}
    plain = _train(tmp_path, name="plain")
    assert sym[0]["loss"] != plain[0]["loss"]  # the noise reached the forward


def test_two_kinds_of_noise_are_refused(tmp_path, capsys):
    code = main(["validate", str(tiny_spec(tmp_path)), "--set", "loss.symnoise_alpha=5", "--set",
                 "loss.neftune_alpha=5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "loss.symnoise_alpha" in err[0]


def test_infosft_reference_mode_is_refused_by_validate(tmp_path, capsys):
    code = main(["validate", str(tiny_spec(tmp_path)), "--set", 'loss.objective="infosft"', "--set",
                 'loss.args={ q_source = "reference" }'])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "loss.args.q_source" in err[0] and "live" in err[0]
    assert main(["validate", str(tiny_spec(tmp_path, "live")), "--set", 'loss.objective="infosft"']) == 0
