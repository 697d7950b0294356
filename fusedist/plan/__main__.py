"""``python -m fusedist.plan``."""

import os
import sys

from .cli import main

# A reader that stops early (``| head``) closes the pipe under the plan's output: that is no
# error of the plan's, and neither a traceback nor status 1 ("nothing fits") may say it is.
# Status 141 is what a shell reports for a writer ended by SIGPIPE (128 + 13), as ``cat``'s.
BROKEN_PIPE_STATUS = 141

try:
    status = main()
    sys.stdout.flush()
except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    status = BROKEN_PIPE_STATUS
raise SystemExit(status)
