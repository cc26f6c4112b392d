"""``python -m bench``: see bench/suites.py and bench/README.md."""

import sys

from bench.suites import main

sys.exit(main())
