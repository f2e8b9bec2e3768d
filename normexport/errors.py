"""Errors that the command line turns into one clear line and an exit code."""


class UsageError(Exception):
    """A user mistake (bad file, bad option, missing flag): exit code 2, no traceback.

    The message names the file, node or option and says how to fix it.
    """
