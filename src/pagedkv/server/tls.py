"""HTTPS for `pagedkv serve`: vLLM's `--ssl-*` flags, checked before the model loads.

uvicorn terminates TLS itself from the files it is given; it reads them only when it starts,
after the model has loaded, and a missing file, a key that does not match its certificate or
a client-certificate rule with no CA to check against would then end a long start-up. `check`
loads them the way uvicorn will (the standard library's server context) while that is still
cheap, so a mistake is one line naming the flag.
"""

from __future__ import annotations

import getpass
import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

# vLLM's `--ssl-cert-reqs` values: the standard library's ssl.CERT_* numbers.
CERT_REQS = {int(mode): mode.name for mode in ssl.VerifyMode}


class TLSConfigError(ValueError):
    """TLS files or flags that cannot serve HTTPS; the message names the flag."""


class _Encrypted(Exception):
    """The key needs a passphrase (raised by `_no_passphrase`, OpenSSL's password callback)."""


def _no_passphrase() -> str:
    raise _Encrypted


@dataclass(frozen=True)
class TLSFiles:
    """The server's key and certificate, and, to ask clients for certificates, the CAs that
    sign them (`cert_reqs` ssl.CERT_OPTIONAL or CERT_REQUIRED). No certificate: plain HTTP."""

    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)
    keyfile_password: str | None = None

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def check(self, ask_passphrase: Callable[[str], str] = getpass.getpass) -> TLSFiles:
        """Load every file as uvicorn will; raise TLSConfigError naming the flag at fault.
        An encrypted key's passphrase is asked for here, once, and returned with the files
        for uvicorn (which would otherwise ask again, once the model had loaded)."""
        if not self.enabled:
            extra = [
                flag
                for flag, given in (
                    ("--ssl-keyfile", self.keyfile is not None),
                    ("--ssl-ca-certs", self.ca_certs is not None),
                    ("--ssl-cert-reqs", self.cert_reqs != ssl.CERT_NONE),
                )
                if given
            ]
            if extra:
                verb = "needs" if len(extra) == 1 else "need"
                raise TLSConfigError(f"{' and '.join(extra)} {verb} --ssl-certfile (HTTPS)")
            return self
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        flags = "--ssl-certfile" + (" / --ssl-keyfile" if self.keyfile else "")
        password = self.keyfile_password
        try:
            try:
                context.load_cert_chain(self.certfile, self.keyfile, password or _no_passphrase)
            except _Encrypted:
                password = ask_passphrase(f"passphrase of {self.keyfile or self.certfile}: ")
                context.load_cert_chain(self.certfile, self.keyfile, password)
        except (OSError, ssl.SSLError) as error:
            problem = f"{flags}: cannot load the key and certificate: {error}"
            raise TLSConfigError(problem) from error
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise TLSConfigError(
                f"--ssl-cert-reqs {self.cert_reqs} ({CERT_REQS[self.cert_reqs]}) checks client "
                "certificates, and needs --ssl-ca-certs to check them against"
            )
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as error:
                raise TLSConfigError(f"--ssl-ca-certs: cannot load: {error}") from error
        return replace(self, keyfile_password=password)

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's own keywords for these files (none for plain HTTP)."""
        if not self.enabled:
            return {}
        return {
            "ssl_keyfile": self.keyfile,
            "ssl_certfile": self.certfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_keyfile_password": self.keyfile_password,
        }
