"""The caller's credential on every call: a Kubernetes ServiceAccount token with Stoker's
audience, sent as ``authorization: Bearer <token>``. Without an explicit token the client reads
the file ``STOKER_TOKEN_FILE`` names, else the default projected-token path if it exists; the
kubelet rotates that file, so it is read again every minute."""

import os
import threading
import time
from typing import Optional, Tuple

DEFAULT_TOKEN_FILE = "/var/run/secrets/stoker.dev/serviceaccount/token"
TOKEN_FILE_ENV = "STOKER_TOKEN_FILE"
_REREAD_AFTER = 60.0

Metadata = Optional[Tuple[Tuple[str, str], ...]]


class TokenSource:
    def __init__(self, token: Optional[str] = None, path: Optional[str] = None):
        self._token = token or None
        if self._token is None and path is None:
            path = os.environ.get(TOKEN_FILE_ENV) or (DEFAULT_TOKEN_FILE if os.path.exists(DEFAULT_TOKEN_FILE) else None)
        self._path = path
        self._lock = threading.Lock()
        self._read: Optional[Tuple[float, str]] = None

    def current(self) -> Optional[str]:
        """The token to send now; None when there is none (the server then says so)."""
        if self._token is not None or self._path is None:
            return self._token
        with self._lock:
            if self._read is not None and time.monotonic() - self._read[0] < _REREAD_AFTER:
                return self._read[1]
            try:
                with open(self._path) as f:
                    self._read = (time.monotonic(), f.read().strip())
            except OSError:
                # Keep a token read before: the kubelet swaps the file by symlink.
                pass
            return self._read[1] if self._read else None

    def metadata(self) -> Metadata:
        token = self.current()
        return (("authorization", f"Bearer {token}"),) if token else None
