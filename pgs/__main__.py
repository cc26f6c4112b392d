"""``python -m pgs`` is the ``pgs`` command."""

from pgs.cli import entry, leave

leave(entry())
