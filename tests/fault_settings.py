"""Environment settings shared by tests that make a rank fail on purpose."""

#: For a peer killed on purpose, where the stall report is not what the test checks: the report
#: would wait its whole window (15 s by default) for an entry the dead rank never writes, after
#: the survivor's collective has already failed.
DEAD_PEER_REPORT = {"FUSEDIST_STALL_REPORT_S": "1"}
