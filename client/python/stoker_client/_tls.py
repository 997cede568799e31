"""How the client reaches the dispatcher and workers: plaintext, or TLS verifying their
certificates against the client's CA (`ca_file`, else the file ``STOKER_CA_FILE`` names).
Workers are dialled by IP but verified against the name the dispatcher's worker list gives
(their Service's), since their certificates cannot name pod IPs known in advance.

The rule, as in the Rust client: ``https://`` means TLS (a CA is then required), ``http://``
plaintext; without a scheme, TLS exactly when the client has a CA. A CA given explicitly with
an ``http://`` URL is refused as a contradiction."""

import os
from typing import List, Optional, Tuple

import grpc

from .errors import TlsError

CA_FILE_ENV = "STOKER_CA_FILE"

# What gRPC's C core says when a handshake fails (certificate not verified, peer not TLS).
_HANDSHAKE_SIGNS = ("handshake failed", "certificate_verify_failed", "ssl_error", "tls", "wrong_version_number",
                    "hostname verification")


class Tls:
    def __init__(self, ca_file: Optional[str] = None, server_name: Optional[str] = None):
        self.explicit = ca_file is not None
        # The name the dispatcher's certificate is for, when its URL's host is not that name
        # (a cluster IP, a port-forward).
        self.dispatcher_name = server_name
        path = ca_file if ca_file is not None else (os.environ.get(CA_FILE_ENV) or None)
        self.ca_path = path
        self.ca: Optional[bytes] = None
        if path is not None:
            try:
                with open(path, "rb") as f:
                    self.ca = f.read()
            except OSError as e:
                raise ValueError(f"reading the CA file {path}: {e}") from None
            if b"-----BEGIN CERTIFICATE-----" not in self.ca:
                raise ValueError(f"the CA file {path} holds no PEM certificate")

    def _uses_tls(self, url: str) -> bool:
        if url.startswith("https://"):
            if self.ca is None:
                raise ValueError(f"{url} asks for TLS but no CA was given (ca_file, or {CA_FILE_ENV})")
            return True
        if url.startswith("http://"):
            if self.explicit:
                raise ValueError(f"{url} asks for plaintext but a CA was given: use https:// (or no scheme) for TLS")
            return False
        return self.ca is not None

    def channel(self, url: str, options: Optional[List[Tuple[str, object]]] = None,
                server_name: Optional[str] = None) -> Tuple[grpc.Channel, str]:
        """(channel, target) for `url`, the dispatcher's or a fixed worker's. `server_name`: a
        worker listed by the dispatcher, None for plaintext ("") or the URL's own rule (None)."""
        target = url.split("://", 1)[1] if "://" in url else url
        options = list(options or [])
        if server_name == "":
            return grpc.insecure_channel(target, options=options), target
        if server_name is not None:
            if self.ca is None:
                raise TlsError(target, f"the pipeline's workers serve TLS (certificates for {server_name}) but the "
                                       f"client has no CA: pass ca_file or set {CA_FILE_ENV}")
            # Dialled by IP, verified as the workers' Service.
            options.append(("grpc.ssl_target_name_override", server_name))
        elif not self._uses_tls(url):
            return grpc.insecure_channel(target, options=options), target
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca)
        return grpc.secure_channel(target, credentials, options=options), target

    def dispatcher_channel(self, url: str) -> Tuple[grpc.Channel, str]:
        """(channel, target) for the dispatcher at `url`, verified as `server_name` if given."""
        if self.dispatcher_name is None or not self._uses_tls(url):
            return self.channel(url)
        return self.channel(url, server_name=self.dispatcher_name)

    def problem(self, e: grpc.RpcError) -> Optional[str]:
        """What went wrong in TLS, if `e` is a handshake failure."""
        details = (e.details() or "") if hasattr(e, "details") else str(e)
        if e.code() == grpc.StatusCode.UNAVAILABLE and any(s in details.lower() for s in _HANDSHAKE_SIGNS):
            if "hostname verification" in details.lower():
                return f"the handshake failed: the server's certificate is not for the name this client expects ({details})"
            trusted = f"the CA in {self.ca_path}" if self.ca_path else "no CA (plaintext)"
            return f"the handshake failed; the client trusts {trusted} ({details})"
        return None

    def plaintext_refused(self, e: grpc.RpcError) -> Optional[str]:
        """Why a plaintext client kept failing, if the server looks like a TLS one: it closes
        every plaintext connection at once. Only said once retrying gave up."""
        if self.ca is None and e.code() == grpc.StatusCode.UNAVAILABLE and "socket closed" in (e.details() or "").lower():
            return (f"the server closes plaintext connections at once and probably serves TLS: use https:// and pass "
                    f"ca_file (or set {CA_FILE_ENV}) ({e.details()})")
        return None
