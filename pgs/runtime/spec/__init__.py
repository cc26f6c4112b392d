"""The run spec: TOML in, typed sections, the chain it names, and the preflight checks."""
