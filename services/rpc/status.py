"""millwheel errors -> gRPC status codes, in one place.

The class of a :class:`~millwheel.errors.MillWheelError` says what kind of failure it
is; its message (which names what and where) becomes the status details.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

import grpc

from millwheel.errors import (
    AlreadyExistsError,
    FencedError,
    InvalidSpecError,
    LogTrimmedError,
    MillWheelError,
    MissingDependencyError,
    NotFoundError,
    PermissionDeniedError,
    ResourceLimitError,
    StoreError,
)
from millwheel.state.lease import LeadershipLostError

log = logging.getLogger("millwheel.service")

F = TypeVar("F", bound=Callable[..., Any])


class PreconditionError(MillWheelError):
    """The request is well formed but the system is not in a state to take it."""


class UnavailableError(MillWheelError):
    """A process the request needs cannot be reached (yet); retrying may succeed."""


class NotLeaderError(UnavailableError):
    """This controller is a standby: ask the leader (the answer names it when known).
    Expected during a leader change and for every worker heartbeat that reaches a
    standby, so it is not logged."""


class BusyError(ResourceLimitError):
    """The injector's outbox is full: retry after ``retry_after_ms`` (backpressure)."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidSpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FencedError, grpc.StatusCode.ABORTED),
    (LeadershipLostError, grpc.StatusCode.UNAVAILABLE),  # ask the leader (or retry: one is elected)
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (MissingDependencyError, grpc.StatusCode.FAILED_PRECONDITION),  # pip install 'millwheel[spark]'
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (LogTrimmedError, grpc.StatusCode.OUT_OF_RANGE),  # a log position removed by retention
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    status = getattr(exc, "status", None)  # an answer passed on from another controller
    if isinstance(status, grpc.StatusCode):
        return status
    for cls, code in CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_class(code: grpc.StatusCode) -> type[MillWheelError]:
    """The client side: a failed call's status back to the error class (for the CLI)."""
    for cls, c in CODES:
        if c == code and issubclass(cls, MillWheelError) and cls is not FencedError:
            return cls
    return MillWheelError


def rpc(fn: F) -> F:
    """Wrap a servicer method: MillWheelErrors abort with their status code."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except MillWheelError as exc:
            code = code_for(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) \
                    and not isinstance(exc, NotLeaderError):
                log.error("%s failed: %s", fn.__name__, exc)
            context.abort(code, str(exc))
        except Exception as exc:  # a bug: say so rather than hang the client
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {exc.__class__.__name__}: {exc}")

    return wrapper  # type: ignore[return-value]


def rpc_stream(fn: F) -> F:
    """Like :func:`rpc` for server-streaming methods (generators)."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from fn(self, request, context)
        except MillWheelError as exc:
            context.abort(code_for(exc), str(exc))
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {exc.__class__.__name__}: {exc}")

    return wrapper  # type: ignore[return-value]
