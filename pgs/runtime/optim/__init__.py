"""Optimizer binding: a pure chain bound to a model's parameters (plain, gradient release, FSDP2-sharded)."""
