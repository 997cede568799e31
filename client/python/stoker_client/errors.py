"""Exceptions for what went wrong at a worker: a gRPC error, or a broken batch stream."""

import grpc


class ProtocolError(Exception):
    """A worker broke the batch stream protocol (or something between mangled it)."""


class WorkerError(Exception):
    """A worker answered with a gRPC error (or could not be reached)."""

    def __init__(self, worker: str, code: grpc.StatusCode, details: str):
        super().__init__(f"worker {worker}: {code.name}: {details}")
        self.worker, self.code, self.details = worker, code, details


class TlsError(WorkerError):
    """TLS with the dispatcher or a worker failed: its certificate does not verify with the
    client's CA or is not for the expected name, or one side does not speak TLS. Not retried:
    it does not fix itself."""

    def __init__(self, peer: str, problem: str):
        Exception.__init__(self, f"TLS with {peer} failed: {problem}")
        self.worker, self.code, self.details = peer, grpc.StatusCode.UNAVAILABLE, problem
