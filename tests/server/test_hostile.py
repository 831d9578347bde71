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


CROSS_SITE_TYPES = [
    pytest.param("text/plain", id="text-plain"),
    pytest.param("application/x-www-form-urlencoded", id="form"),
    pytest.param("multipart/form-data; boundary=x", id="multipart"),
    pytest.param(None, id="none"),  # what a page's fetch() sends for an untyped Blob body
]


@pytest.mark.parametrize("content_type", CROSS_SITE_TYPES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_json_body_not_sent_as_json_is_refused_with_415(
    server: RunningServer, path: str, content_type: str | None
) -> None:
    body = b'{"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
    headers = {"Content-Type": content_type} if content_type else {}
    with server.http() as http:
        response = http.post(path, content=body, headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]


def test_json_with_a_charset_is_accepted(server: RunningServer) -> None:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            content=b'{"prompt": "Hi", "max_tokens": 1}',
            headers={"Content-Type": "application/json; charset=utf-8"},
        )
    assert response.status_code == 200, response.text
