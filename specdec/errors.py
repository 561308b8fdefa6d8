"""The errors engines raise, each with the gRPC status it maps to (mapped in one place: specdec/serving/rpc.py)."""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """Base class: an error a client should see with a precise status code."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError):
    """A request field is out of range; `field` names it, as in google.rpc.BadRequest."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str, reason: str = "invalid_value"):
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description
        self.reason = reason  # a machine-readable kind, the HTTP API's error `code` (OpenAI's names)


class SequenceNotFound(SpecdecError):
    """The service does not hold the sequence (or holds less of it than the caller believes).

    The coordinator answers this by re-sending the whole canonical sequence: caches are soft state.
    """

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, sequence_id: str, detail: str):
        super().__init__(f"sequence_id: {sequence_id!r} {detail}")
        self.sequence_id = sequence_id


class SequenceReleased(SpecdecError):
    """The sequence id was released: a call that arrives after its Release (a late, cancelled call
    overtaken on the wire) must not bring the sequence back to life and leak its cache."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, sequence_id: str):
        super().__init__(f"sequence_id: {sequence_id!r} was released; use a new id for a new sequence")
        self.sequence_id = sequence_id


class Overloaded(SpecdecError):
    """The service is at its capacity; the client should retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    """A service this one depends on cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    """The client's deadline passed before the request could finish."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
