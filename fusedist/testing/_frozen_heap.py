"""Imported last by the test harness's fork server (Note [a frozen heap for forked ranks] in
``multiprocess.py``): what the server imported moves to the collector's permanent
generation, which the ranks it forks inherit and never scan again."""

import atexit
import gc

gc.collect()
gc.freeze()
# The server's own shutdown sees its objects as it would have: a frozen heap at interpreter
# exit has extension modules report the objects still alive there as leaks.
atexit.register(gc.unfreeze)
