"""Exceptions for what went wrong at a worker or the dispatcher: a gRPC status, a broken batch
stream, or TLS. The Rust client raises them (its errors mapped in client/python/src/convert.rs)."""

import enum


class StatusCode(enum.Enum):
    """gRPC's status codes, by gRPC's names and numbers."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ProtocolError(Exception):
    """A worker broke the batch stream protocol (or something between mangled it)."""


class WorkerError(Exception):
    """A worker (or the dispatcher) answered with a gRPC error, or could not be reached.
    `code` is a `StatusCode`."""

    def __init__(self, worker: str, code, details: str):
        code = code if isinstance(code, StatusCode) else StatusCode[code]
        super().__init__(f"worker {worker}: {code.name}: {details}")
        self.worker, self.code, self.details = worker, code, details


class TlsError(WorkerError):
    """TLS with the dispatcher or a worker failed: its certificate does not verify with the
    client's CA or is not for the expected name, or one side does not speak TLS. Not retried:
    it does not fix itself."""

    def __init__(self, peer: str, problem: str):
        Exception.__init__(self, f"TLS with {peer} failed: {problem}")
        self.worker, self.code, self.details = peer, StatusCode.UNAVAILABLE, problem
