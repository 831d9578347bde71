"""`pagedkv serve` over HTTPS with vLLM's `--ssl-*` flags: certificates made here by the
`openssl` command (a CA, a server certificate for 127.0.0.1 and a client certificate it
signs), checked by the standard library's TLS client, which is independent of the server."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx2
import pytest
from uvicorn.config import create_ssl_context

from pagedkv.cli import main
from pagedkv.server.tls import TLSConfigError, TLSFiles
from tests.server.conftest import HANG_GUARD_S, start_serve, stop_serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem/key, server.pem/key (for 127.0.0.1, signed by the CA), client.pem/key (signed
    by the CA) and other.pem/key (self-signed, no relation to the CA). Requests signed with
    `x509 -req`, which OpenSSL 1.1 has too, with the extensions strict verification asks for."""
    folder = tmp_path_factory.mktemp("pki")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*arguments: str) -> None:
        subprocess.run(["openssl", *arguments], check=True, capture_output=True)

    def request(name: str, subject: str) -> list[str]:
        """A new key and a request (or, with -x509, a self-signed certificate) for it."""
        return ["req", *key, "-subj", subject, "-keyout", str(folder / f"{name}.key")]

    ca = ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign"]
    for name, extensions in (("ca", ca), ("other", [])):  # other: no relation to the CA
        self_signed = ["-x509", "-days", "2", "-out", str(folder / f"{name}.pem"), *extensions]
        openssl(*request(name, f"/CN=pagedkv test {name}"), *self_signed)
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        csr, extensions = folder / f"{name}.csr", folder / f"{name}.ext"
        extensions.write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
            "authorityKeyIdentifier=keyid\nsubjectAltName=IP:127.0.0.1\n"
        )
        openssl(*request(name, f"/CN={name}"), "-new", "-out", str(csr))
        openssl(
            *("x509", "-req", "-in", str(csr), "-days", "2", "-out", str(folder / f"{name}.pem")),
            *("-CA", str(folder / "ca.pem"), "-CAkey", str(folder / "ca.key")),
            *("-CAcreateserial", "-extfile", str(extensions)),
        )
    return folder


def server_certificate(pki: Path) -> tuple[str, ...]:
    """The flags serving HTTPS with the CA-signed certificate for 127.0.0.1."""
    return ("--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key"))


def client_context(pki: Path, certificate: str | None = None) -> ssl.SSLContext:
    """A TLS client trusting only the test CA, presenting `certificate` if named."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if certificate is not None:
        context.load_cert_chain(pki / f"{certificate}.pem", pki / f"{certificate}.key")
    return context


def test_serve_answers_https_with_its_certificate_and_not_plain_http(tiny_model, pki) -> None:
    server, url = start_serve(tiny_model, *server_certificate(pki), verify=client_context(pki))
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        response = httpx2.post(
            f"{url}/v1/completions", json=body, verify=client_context(pki), timeout=HANG_GUARD_S
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx2.TransportError):  # the port speaks TLS only
            httpx2.get(url.replace("https:", "http:") + "/health", timeout=HANG_GUARD_S)
        with pytest.raises(httpx2.TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting = ssl.create_default_context(cafile=str(pki / "other.pem"))
            httpx2.get(f"{url}/health", verify=untrusting, timeout=HANG_GUARD_S)
    finally:
        output = stop_serve(server)
    assert f"page map: {url}/" in output


def test_client_certificates_signed_by_the_ca_are_required_when_asked(tiny_model, pki) -> None:
    server, url = start_serve(
        tiny_model,
        *server_certificate(pki),
        *("--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))),
        verify=client_context(pki, "client"),
    )
    try:
        for refused in (None, "other"):  # no certificate; one the CA did not sign
            with pytest.raises(httpx2.TransportError):
                response = httpx2.get(
                    f"{url}/health", verify=client_context(pki, refused), timeout=HANG_GUARD_S
                )
                response.read()
    finally:
        stop_serve(server)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-certfile", "{missing}"], "--ssl-certfile: cannot load the key and certificate"),
        (
            ["--ssl-certfile", "{pki}/server.pem", "--ssl-keyfile", "{pki}/other.key"],
            "--ssl-certfile / --ssl-keyfile: cannot load the key and certificate",
        ),
        (["--ssl-keyfile", "{pki}/server.key"], "--ssl-keyfile needs --ssl-certfile"),
        (
            ["--ssl-certfile", "{pki}/server.pem", "--ssl-keyfile", "{pki}/server.key"]
            + ["--ssl-cert-reqs", "2"],
            "--ssl-cert-reqs 2 (CERT_REQUIRED) checks client certificates, and needs "
            "--ssl-ca-certs",
        ),
        (
            ["--ssl-certfile", "{pki}/server.pem", "--ssl-keyfile", "{pki}/server.key"]
            + ["--ssl-ca-certs", "{missing}"],
            "--ssl-ca-certs: cannot load",
        ),
    ],
)
def test_bad_tls_flags_are_one_line_before_the_model_loads(flags, message, pki, tmp_path, capsys):
    """The model named does not exist: the TLS error comes first, before any loading."""
    argv = ["serve", "--model", str(tmp_path / "no-model")]
    argv += [flag.format(pki=pki, missing=tmp_path / "missing.pem") for flag in flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv serve: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_an_encrypted_key_is_asked_for_once_and_handed_to_uvicorn(pki, tmp_path) -> None:
    """An encrypted key's passphrase is asked for before the model loads, once, and uvicorn's
    own TLS set-up (the oracle) loads the key with what was asked; a wrong one is refused."""
    encrypted = tmp_path / "server-encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki / "server.key"), "-out", str(encrypted)]
        + ["-aes256", "-passout", "pass:open sesame"],
        check=True,
        capture_output=True,
    )
    files = TLSFiles(keyfile=str(encrypted), certfile=str(pki / "server.pem"))
    asked: list[str] = []

    def ask(prompt: str) -> str:
        asked.append(prompt)
        return "open sesame"

    checked = files.check(ask_passphrase=ask)
    assert asked == [f"passphrase of {encrypted}: "]
    options = checked.uvicorn_options()
    assert options["ssl_keyfile_password"] == "open sesame"
    create_ssl_context(
        certfile=options["ssl_certfile"],
        keyfile=options["ssl_keyfile"],
        password=options["ssl_keyfile_password"],
        ssl_version=ssl.PROTOCOL_TLS_SERVER,
        cert_reqs=options["ssl_cert_reqs"],
        ca_certs=None,
        ciphers=None,
    )
    assert (
        TLSFiles(certfile=str(pki / "server.pem"), keyfile=str(pki / "server.key"))
        .check(ask_passphrase=ask)
        .uvicorn_options()["ssl_keyfile_password"]
        is None
    )
    assert len(asked) == 1  # an unencrypted key asks nothing
    with pytest.raises(TLSConfigError, match="--ssl-certfile / --ssl-keyfile: cannot load"):
        files.check(ask_passphrase=lambda prompt: "wrong")
