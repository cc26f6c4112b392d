"""The tiny random-init models the tests build (no downloads): one shape, one way to build it.

- ``tiny_config(model_type, **fields)``: a transformers config of the family ``model_type`` with
  ``SHAPE`` (2 layers, hidden 32, 4 query heads of 8 over 2 key/value heads, vocabulary 96),
  ``fields`` changed; a field set to None is left out (the family's default).
- ``tiny_model(model_type, seed=..., dtype=..., **fields)``: that config's causal LM, its weights
  drawn under ``torch.manual_seed(seed)``.
- ``from_config(config, ...)``: the same for a config built elsewhere.
- ``shape_table(model_type, **fields)``: ``SHAPE`` as a ``[model.config]`` table, for the tests
  that build through pgs's own ``build_model``.
- ``tiny_table(**changes)``: the ``[model.config]`` table of the tiny Qwen3 that ``pgs run``
  trains in the tests (the quickstart tokenizer's vocabulary; tests/helpers.py writes it into specs).
"""

from __future__ import annotations

import contextlib

import torch

#: The in-process tiny shape (a family's own fields, e.g. experts, come as ``fields``).
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)

#: The tiny Qwen3 of the specs the tests run (random init, the quickstart tokenizer's vocabulary):
#: trains on the CPU in seconds.
TINY_TABLE = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                  tie_word_embeddings=True)


def _without_none(table: dict) -> dict:
    return {k: v for k, v in table.items() if v is not None}


def tiny_table(**changes) -> dict:
    """``TINY_TABLE`` with ``changes``; a change to None leaves that key out."""
    return _without_none({**TINY_TABLE, **changes})


def shape_table(model_type: str = "qwen3", **fields) -> dict:
    """``SHAPE`` with ``fields`` (None: left out) and its ``model_type``: a ``[model.config]`` table."""
    return _without_none({"model_type": model_type, **SHAPE, **fields})


def tiny_config(model_type: str = "qwen3", **fields):
    """A transformers config of ``model_type`` with ``SHAPE`` and ``fields`` (None: left out)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_without_none({**SHAPE, **fields}))


def from_config(config, *, seed: int | None = 0, init_dtype: torch.dtype | None = None,
                dtype: torch.dtype | None = None, mode: str | None = "train", fork_rng: bool = False,
                **kwargs):
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` with its weights drawn under
    ``torch.manual_seed(seed)`` (None: the global generator as it is).

    ``init_dtype``: the dtype the weights are drawn in (``from_config``'s ``dtype``); ``dtype``: a
    cast after the draw; ``mode``: ``"train"``, ``"eval"`` or None (as built); ``fork_rng``: the
    draw leaves the caller's random state as it was."""
    from transformers import AutoModelForCausalLM

    if init_dtype is not None:
        kwargs["dtype"] = init_dtype
    with torch.random.fork_rng() if fork_rng else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if dtype is not None:
        model = model.to(dtype)
    if mode == "train":
        model.train()
    elif mode == "eval":
        model.eval()
    return model


def tiny_model(model_type: str = "qwen3", *, seed: int | None = 0, init_dtype: torch.dtype | None = None,
               dtype: torch.dtype | None = None, mode: str | None = "train", fork_rng: bool = False,
               **fields):
    """The causal LM of ``tiny_config(model_type, **fields)``, built by ``from_config``."""
    return from_config(tiny_config(model_type, **fields), seed=seed, init_dtype=init_dtype, dtype=dtype,
                       mode=mode, fork_rng=fork_rng)
