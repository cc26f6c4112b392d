"""Benchmarks of pgs (not part of the installed package): ``python -m bench --list``."""
