"""The one exception type the command line turns into a one-line message."""


class ClientError(Exception):
    """A problem to report as one line (no traceback), with what to do about it."""
