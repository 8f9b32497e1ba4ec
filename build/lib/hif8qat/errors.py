"""The one base class for failures a user can act on.

run.py prints such an error as ``error: <message>`` and exits with status 2 instead of a traceback, so every
module raises a subclass of RunError (with a message that names the setting or file and what to do) for
anything caused by the user's input, files on disk or the environment, and lets real bugs propagate.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A failure caused by input, files or environment, reported as ``error: <message>`` (exit status 2)."""
