"""CORS, vLLM's flags: web pages of the origins `--allowed-origins` names may call the API.

The oracle is the Fetch standard's CORS protocol: a browser sends a preflight (OPTIONS with
`Origin` and `Access-Control-Request-Method`, never the API key) before a JSON POST, and lets
the page read a response only when `Access-Control-Allow-Origin` names its origin (or is
`*`). Without the flag no origin is named, so a page of another site cannot use the server.
"""

from __future__ import annotations

import argparse

import httpx2
import pytest

from pagedkv.commands import serve as serve_command
from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer

API_KEY = "cors-key"
UI = "https://ui.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def servers(serve) -> dict[str, RunningServer]:
    return {
        "allowed": serve(ServerConfig(api_key=API_KEY, allowed_origins=(UI,)), num_gpu_blocks=32),
        "default": serve(ServerConfig(api_key=API_KEY), num_gpu_blocks=32),
    }


def browser(server: RunningServer) -> httpx2.Client:
    """A client that sends only the headers a test names, as a page's fetch() does."""
    return httpx2.Client(base_url=server.url, timeout=30.0)


def test_a_named_origins_page_may_call_the_api_with_its_key(servers) -> None:
    with browser(servers["allowed"]) as http:
        preflight = http.options("/v1/completions", headers={"Origin": UI, **PREFLIGHT})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == UI
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        body = {"prompt": "Hi", "max_tokens": 2}
        headers = {"Origin": UI, "Authorization": f"Bearer {API_KEY}"}
        answer = http.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == UI
        # A refusal is readable by the page too: it can show why.
        refused = http.post("/v1/completions", json=body, headers={"Origin": UI})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == UI


@pytest.mark.parametrize(
    ("server", "origin"), [("allowed", "https://evil.example"), ("default", UI)]
)
def test_other_origins_get_no_allowance(servers, server, origin) -> None:
    with browser(servers[server]) as http:
        preflight = http.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
        assert preflight.status_code >= 400
        assert "access-control-allow-origin" not in preflight.headers
        answer = http.get("/health", headers={"Origin": origin})
        assert "access-control-allow-origin" not in answer.headers


def test_the_flags_take_vllms_json_lists() -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    flags = ["--allowed-origins", f'["{UI}", "http://localhost:3000"]', "--allow-credentials"]
    config = serve_command.server_config(parser.parse_args(flags))
    assert config.allowed_origins == (UI, "http://localhost:3000")
    assert config.allow_credentials and config.allowed_methods == ("*",)
    assert serve_command.server_config(parser.parse_args([])).allowed_origins == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", UI])  # not JSON: refused, naming the value
