"""Every spec shipped in specs/ passes `pgs validate` (model, tokenizer, data and chain)."""

from pathlib import Path

import pytest

from pgs.cli import main

SPECS = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.toml"))


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_shipped_spec_validates(path, capsys):
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_there_are_shipped_specs():
    assert any(p.name == "quickstart.toml" for p in SPECS)
