"""The training loop and its services: control plane, evaluation, metrics, profiler trace."""
