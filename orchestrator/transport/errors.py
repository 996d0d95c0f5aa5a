"""What can go wrong reaching a host; every message is for the user as-is."""
from __future__ import annotations

from ..errors import OperationFailed


class TransportError(OperationFailed):
    """A host could not be reached or a command could not be run."""


class HostKeyError(TransportError):
    """The host's key is unknown or does not match known_hosts."""


class CommandTimeout(TransportError):
    """A command ran past its timeout and was killed."""


class CommandFailed(TransportError):
    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result
