"""Hostile clients: requests refused on their headers alone, before the server reads a body.

The raw-socket helper sends exactly the bytes a hostile client would (headers and no body),
which an HTTP client library cannot.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer

API_KEY = "hostile-key"
# Only a guard against a hang: a refused request is answered as soon as its headers arrive.
RESPONSE_GUARD_S = 30.0


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(ServerConfig(api_key=API_KEY), num_gpu_blocks=64)


def raw_exchange(server: RunningServer, head: str) -> tuple[int, bytes]:
    """Send `head` (request line and headers, no body) and read the reply until the server
    closes the connection; return the status code and the whole reply."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=RESPONSE_GUARD_S) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def test_wrong_key_is_refused_before_the_body_arrives(server: RunningServer) -> None:
    host = urlsplit(server.url).netloc
    head = (
        f"POST /v1/completions HTTP/1.1\nHost: {host}\nAuthorization: Bearer wrong\n"
        "Content-Type: application/json\nContent-Length: 1000000\n\n"
    )
    status, reply = raw_exchange(server, head)
    assert status == 401
    assert b'"code":"invalid_api_key"' in reply
