"""bench/generate.py at its CPU smoke shape: every setup samples the full length (no stop ids for
pgs, ``min_new_tokens`` for transformers), the figures are the documented ratios, transformers'
setups run on its own SDPA and leave the model's attention as it was, ``--profile`` adds its table."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import generate as bench  # noqa: E402


def test_small_run_of_every_setup(tmp_path):
    out = tmp_path / "generate.json"
    assert bench.main(["--small", "--profile", "3", "--widths", "5,9,5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["setup"]: r for r in result["results"]}
    assert list(rows) == list(bench.SETUPS)
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert r["sampled_tokens"] == 3 * 6  # every row decodes --new-tokens (the smoke shape: 3 x 6)
        assert r["tok_s"] == r["sampled_tokens"] / r["seconds"]
        assert r["floor_fraction"] == result["decode_floor_ms"] / r["decode_ms"]
        assert "kernels" in r and "kernels_per_token" in r  # --profile (no device kernels on the CPU)
        assert [w["prompt_tokens"] for w in r["widths"]] == [5, 9, 5] and all(w["tok_s"] > 0 for w in r["widths"])
    assert result["pgs_over"] == {k: rows["pgs"]["tok_s"] / r["tok_s"] for k, r in rows.items() if k != "pgs"}


def test_widths_refused_unless_prompt_lengths(capsys):
    for bad in ("3,x", "0,4"):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--small", "--widths", bad])
        assert exit_.value.code == 2 and "--widths" in capsys.readouterr().err


def test_transformers_setups_run_on_sdpa_and_restore_the_model(monkeypatch):
    from pgs.runtime.model.build import build_model

    model = build_model(config=bench.SMALL, dtype="bfloat16", attn_implementation="varlen").eval()
    own = model.config._attn_implementation
    seen = []
    monkeypatch.setattr(bench, "_hf_generate", lambda m, *a: seen.append(m.config._attn_implementation) or 0)
    bench._hf(model, [[1, 2, 3]], 2, True, 0)
    assert seen == ["sdpa"] and model.config._attn_implementation == own != "sdpa"
