"""megastart's errors: one family, so a host or a user catches ``MegastartError`` or one kind.

Every message names the phase, the file, the tensor and the fix where they apply;
the command line prints it alone, without a traceback (``megastart --debug`` shows one).
"""

from __future__ import annotations


class MegastartError(Exception):
    """Any error megastart raises on purpose (bad input, settings, a failed collective, a host)."""


class SettingsError(MegastartError, ValueError):
    """A setting is unknown or has a value of the wrong type (message names it and the valid ones)."""


class CheckpointError(MegastartError, ValueError):
    """The checkpoint directory cannot be loaded as it is (message says why and what to do)."""


class PlanError(MegastartError, ValueError):
    """The checkpoint does not fit the model that was built (message names tensors and shapes)."""


class CollectiveError(MegastartError, RuntimeError):
    """A collective phase failed on some rank, stalled, or a rank never joined it; raised on
    every rank with the same message."""


class HostError(MegastartError, RuntimeError):
    """The host cannot be served as it is (its version, its call sequence)."""
