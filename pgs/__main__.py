"""``python -m pgs`` is the ``pgs`` command."""

from pgs.cli import main

raise SystemExit(main())
