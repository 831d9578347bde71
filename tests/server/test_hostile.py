"""Hostile clients: requests refused on their headers alone, before the server reads a body.

The raw-socket helper sends exactly the bytes a hostile client would (headers and no body),
which an HTTP client library cannot.
"""

from __future__ import annotations

import argparse
import socket
from urllib.parse import urlsplit

import pytest

from pagedkv.commands import serve as serve_command
from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer

API_KEY = "hostile-key"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# Only a guard against a hang: a refused request is answered as soon as its headers arrive.
RESPONSE_GUARD_S = 30.0


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    config = ServerConfig(api_key=API_KEY, allowed_hosts=LOOPBACK_HOSTS)
    return serve(config, num_gpu_blocks=64)


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


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/v1/models", "/v1/kv"])
def test_a_post_to_a_get_route_is_405_before_its_content_type_is_checked(
    server: RunningServer, path: str
) -> None:
    # The method is checked first, as FastAPI routes vLLM's server: the route takes no body.
    with server.http() as http:
        response = http.post(path, content=b"x", headers={"Content-Type": "text/plain"})
    assert response.status_code == 405, response.text
    assert "GET" in response.headers["allow"].split(", ")


def test_a_post_to_an_unknown_path_is_404_before_its_content_type_is_checked(
    server: RunningServer,
) -> None:
    with server.http() as http:
        response = http.post("/v1/nothing", content=b"x", headers={"Content-Type": "text/plain"})
    assert response.status_code == 404, response.text


def test_json_with_a_charset_is_accepted(server: RunningServer) -> None:
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            content=b'{"prompt": "Hi", "max_tokens": 1}',
            headers={"Content-Type": "application/json; charset=utf-8"},
        )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/"])
def test_a_foreign_host_is_refused_naming_it(server: RunningServer, path: str) -> None:
    # A DNS-rebinding page reaches 127.0.0.1 under its own name, which the Host header keeps.
    port = urlsplit(server.url).port
    with server.http() as http:
        response = http.get(path, headers={"Host": f"rebind.example:{port}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_host" and "rebind.example" in error["message"]


def test_a_foreign_host_is_refused_before_the_body_arrives(server: RunningServer) -> None:
    head = (
        f"POST /v1/completions HTTP/1.1\nHost: rebind.example\nAuthorization: Bearer {API_KEY}\n"
        "Content-Type: application/json\nContent-Length: 1000000\n\n"
    )
    status, reply = raw_exchange(server, head)
    assert status == 400
    assert b"rebind.example" in reply


@pytest.mark.parametrize("name", [*LOOPBACK_HOSTS, "LocalHost"])
def test_the_loopback_names_are_served(server: RunningServer, name: str) -> None:
    port = urlsplit(server.url).port
    with server.http() as http:
        assert http.get("/health", headers={"Host": f"{name}:{port}"}).status_code == 200
        assert http.get("/health", headers={"Host": name}).status_code == 200


@pytest.mark.parametrize(
    ("flags", "allowed"),
    [
        pytest.param([], LOOPBACK_HOSTS, id="loopback-default"),
        pytest.param(["--host", "::1"], LOOPBACK_HOSTS, id="ipv6-loopback-default"),
        pytest.param(["--host", "0.0.0.0"], None, id="public-any-host"),
        pytest.param(
            ["--host", "0.0.0.0", "--allowed-hosts", "a.example", "b.example"],
            ("a.example", "b.example"),
            id="explicit",
        ),
    ],
)
def test_serve_allowed_hosts_default_follows_the_bind_address(
    flags: list[str], allowed: tuple[str, ...] | None
) -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    config = serve_command.server_config(parser.parse_args(flags))
    assert config.allowed_hosts == allowed


def test_a_post_without_a_body_has_no_type_to_check(server: RunningServer) -> None:
    """vLLM's `/ping` probe and a Responses cancel are POSTs with no body: not a 415, the
    route answers (a body not sent as JSON still is one, above)."""
    with server.http() as http:
        assert http.post("/ping").json() == {"status": "ok"}
        assert http.get("/ping").status_code == 200
        cancel = http.post("/v1/responses/resp_none/cancel")
        assert cancel.status_code == 404 and "not found" in cancel.json()["error"]["message"]
        typed = http.post("/ping", content=b"x", headers={"Content-Type": "text/plain"})
        assert typed.status_code == 415
