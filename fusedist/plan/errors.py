"""The one error type of the planner: bad input, named by the flag it came from."""

from __future__ import annotations


class PlanError(ValueError):
    """Input the planner cannot work with. ``flag`` names the command-line option (e.g.
    ``--heads``) so the CLI can end with one line that says which option to fix; empty for
    argparse's own messages, which name it themselves."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag
