"""TLS against `stoker local --tls`: its dispatcher and workers serve TLS with certificates of a
throwaway CA. A client given that CA reads batches (from workers it dials by IP and verifies
by their Service's name); one given another CA fails at once with a TlsError saying why."""

import re
import subprocess
import time

import pytest

from stoker_client import Client, TlsError

from conftest import images_in, pipeline_file, within
from test_dispatcher import Local


def ca_file(local: Local, timeout: float = 30.0) -> str:
    """The CA `stoker local --tls` printed (the line after the URL)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"clients trust the CA in (\S+)", "".join(local.lines))
        if match:
            return match.group(1)
        assert local.process.poll() is None, "".join(local.lines)
        time.sleep(0.05)
    pytest.fail("no CA printed:\n" + "".join(local.lines))


def test_a_client_with_the_ca_reads_over_tls(tmp_path, corpus):
    with Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4), args=["--tls"]) as local:
        address, ca = local.address(), ca_file(local)
        assert "https://" + address in "".join(local.lines), "the dispatcher serves TLS"
        with Client.from_dispatcher(address, "test", "py", ca_file=ca) as client:
            batches = within(60, lambda: [b for _, b in zip(range(images_in(corpus) // 4), client.iter_epoch())])
        assert sum(len(b["label"]) for b in batches) == images_in(corpus), "the whole epoch over TLS"
        # Dialled by an address, verified as a name the certificate holds (as through a
        # port-forward to a Service): localhost is accepted, a name it does not hold refused.
        with Client.from_dispatcher(address, "test", "py", ca_file=ca, tls_server_name="localhost") as client:
            assert len(within(60, lambda: next(iter(client.iter_epoch())))["label"]) == 4
        with pytest.raises(TlsError) as failed:
            Client.from_dispatcher(
                address, "test", "py", ca_file=ca, tls_server_name="elsewhere.example", connect_timeout=20
            )
        assert "not for the name this client expects" in str(failed.value), str(failed.value)


def test_a_client_with_another_ca_fails_clearly(tmp_path, corpus):
    other = tmp_path / "other"
    other.mkdir()
    key, cert = other / "ca.key", other / "ca.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=another CA",
        ],
        check=True,
        capture_output=True,
    )
    with Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4), args=["--tls"]) as local:
        address = local.address()
        started = time.monotonic()
        with pytest.raises(TlsError) as failed:
            Client.from_dispatcher(address, "test", "py", ca_file=str(cert), connect_timeout=20)
        assert time.monotonic() - started < 10, "failed at once, not after the connect timeout"
        assert "not signed by a CA this client trusts" in str(failed.value), str(failed.value)
        # Plaintext to a TLS dispatcher: refused after the connect timeout (gRPC retries a
        # closed socket), saying it is probably TLS.
        with pytest.raises(TlsError) as failed:
            Client.from_dispatcher("http://" + address, "test", "py", connect_timeout=2)
        assert "probably serves TLS" in str(failed.value), str(failed.value)
