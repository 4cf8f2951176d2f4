"""Every error millwheel raises derives from :class:`MillWheelError`.

Callers (the CLI, the gRPC layer) map these classes to exit codes and gRPC status
codes in one place each, so the classes say *what kind* of failure it is and the
message says *what and where*.
"""

from __future__ import annotations


class MillWheelError(Exception):
    """Root of every millwheel error."""


class InvalidSpecError(MillWheelError):
    """A topology, computation spec, option or record is malformed."""


class NotFoundError(MillWheelError):
    """A named computation, stream, injector or key does not exist."""


class AlreadyExistsError(MillWheelError):
    """A computation or stream of that name is already registered."""


class ResourceLimitError(MillWheelError):
    """A value or batch is over a configured size limit."""


class PermissionDeniedError(MillWheelError):
    """The deployment does not allow this: user code outside the ``--allow-code`` list."""


class MissingDependencyError(MillWheelError):
    """An optional part of millwheel is used but its package is not installed here (Spark
    stages without pyspark); the message says what to install."""


class FencedError(MillWheelError):
    """A write carried a sequencer token that is no longer current.

    The writer has lost ownership of the key range (it is a zombie) and must stop
    writing for it.
    """

    def __init__(self, computation: str, range_id: int, token: int, current: int | None):
        self.computation = computation
        self.range_id = range_id
        self.token = token
        self.current = current
        super().__init__(
            f"write to {computation!r} range {range_id} fenced: token {token} is not "
            f"current (current token is {current}); this worker lost the range"
        )


class ConnectorError(MillWheelError):
    """An external system a source or sink connects to is unreachable or refused a call
    (millwheel.connectors); the runtime retries with backoff, losing nothing."""


class StoreError(MillWheelError):
    """The state store failed or holds data millwheel cannot read."""


class CorruptDataError(StoreError):
    """A stored value has the wrong type or shape; the message names the key."""


class UserCodeError(MillWheelError):
    """User computation code raised; the message names computation, key and record.

    The error policy (:mod:`millwheel.runtime.poison`) reads the attributes: ``item_id``
    (the record ID or timer identity that failed, None when unknown), ``key``, the
    original exception's ``exc_type`` and ``exc_message``, ``frames`` (the last frames
    of its traceback) and ``final`` (retrying cannot help: the key could not be
    extracted, or the item already used up its attempts without running).
    """

    def __init__(
        self, message: str, *, key: str | None = None, item_id: str | None = None,
        exc_type: str = "", exc_message: str = "", frames: tuple[str, ...] = (),
        final: bool = False,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.item_id = item_id
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.frames = frames
        self.final = final


class DeadlineExceeded(UserCodeError):
    """User code overran its deadline (``options.max_batch_seconds``) on a record alone.

    The worker's watchdog killed the worker when it happened; the record is not run
    again. The message names computation, range and record.
    """


class LogTrimmedError(MillWheelError):
    """A read of a stream log from a position its retention already removed
    (``Options.log_retention_us`` / ``log_retention_bytes``): the records between that
    position and ``oldest`` are gone. ``oldest`` is the oldest available position (a
    read after it gets every record still retained); None when only the message is
    known (the client side of a failed call)."""

    def __init__(self, message: str, oldest: int | None = None) -> None:
        super().__init__(message)
        self.oldest = oldest
