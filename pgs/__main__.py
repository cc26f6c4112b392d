"""``python -m pgs`` is the ``pgs`` command."""

import os
import sys

from pgs.cli import entry

code = entry()
if os.environ.get("PGS_EXIT_DIR"):  # a worker of `pgs run --nproc`: its launcher reads this code
    from pgs.runtime.dist.launch import record_exit

    record_exit(code)
if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    # Under torchrun, leave without running C++ static destructors: a gloo/NCCL worker thread
    # still winding down can abort the process ("terminate called without an active
    # exception") after the run has finished and written everything, turning exit 0/143 into
    # SIGABRT.  Everything the run writes is flushed and fsynced before this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
