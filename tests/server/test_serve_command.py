"""`pagedkv serve` as a user runs it: a subprocess on loopback, the key from the environment."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.cli import main
from tests.server.conftest import HANG_GUARD_S, start_serve, stop_serve


def test_serve_help_lists_engine_and_server_options(capsys) -> None:
    try:
        main(["serve", "--help"])
    except SystemExit as exit:
        assert exit.code == 0
    help_text = capsys.readouterr().out
    options = ("--model", "--num-gpu-blocks", "--host", "--port", "--api-key", "--max-waiting")
    hardening = ("--max-connections", "--request-read-timeout", "--max-page-map-viewers")
    for option in (*options, "--strict-fields", *hardening, "--shutdown-timeout"):
        assert option in help_text


def test_a_bad_model_or_engine_flag_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nowhere")
    cases = [
        (["serve", "--model", missing], "is not a model folder"),
        (["serve", "--num-gpu-blocks", "0"], "--num-gpu-blocks must be a positive integer"),
        (["serve", "--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (["bench", "--model", missing], "is not a model folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pagedkv {argv[0]}: ") and message in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_port_outside_0_to_65535_is_refused_before_the_model_loads(capsys) -> None:
    for bad in ("65536", "-1"):
        with pytest.raises(SystemExit) as exit:
            main(["serve", "--model", "unused", "--port", bad])
        assert exit.value.code == 2
        assert f"--port: must be a port from 0 to 65535, got {bad}" in capsys.readouterr().err


def test_serve_runs_with_the_api_key_from_the_environment(tiny_model: Path) -> None:
    env = dict(os.environ, PAGEDKV_API_KEY="from-env")
    server, url = start_serve(
        tiny_model, "--strict-fields", "--reasoning-parser", "qwen3",
        "--trust-request-chat-template", env=env,
    )  # fmt: skip
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        refused = httpx2.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert refused.status_code == 401
        response = httpx2.post(
            f"{url}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer from-env"},
            timeout=HANG_GUARD_S,
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        unknown = httpx2.post(
            f"{url}/v1/completions",
            json={**body, "frobnicate": 1},
            headers={"Authorization": "Bearer from-env"},
            timeout=HANG_GUARD_S,
        )
        assert unknown.status_code == 400
        assert unknown.json()["error"]["param"] == "frobnicate"
        thinking = httpx2.post(  # a prompt that opens a think block: the reply is reasoning
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "chat_template": "{{ messages[0].content }}"
                "{% if add_generation_prompt %}<think>{% endif %}",
                "max_tokens": 3,
                "ignore_eos": True,
            },
            headers={"Authorization": "Bearer from-env"},
            timeout=HANG_GUARD_S,
        )
        message = thinking.json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning"] == message["reasoning_content"]
    finally:
        output = stop_serve(server)
    assert f"{url}/" in output  # where the page map is
    assert '"POST /v1/completions HTTP/1.1" 200' in output  # uvicorn's access log


def test_with_speculation_serve_ends_with_the_acceptance_its_metrics_counted(
    tiny_model: Path,
) -> None:
    """The line a speculating server prints as it stops carries the counters /metrics
    exported (verifications, drafted tokens) with the acceptance rate they give."""
    spec = json.dumps({"model": str(tiny_model), "num_speculative_tokens": 3})
    server, url = start_serve(tiny_model, "--speculative-config", spec)
    try:
        body = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        response = httpx2.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert response.status_code == 200
        metrics = httpx2.get(f"{url}/metrics", timeout=HANG_GUARD_S).text
    finally:
        output = stop_serve(server)
    counted = {
        sample.name.removeprefix("pagedkv:spec_decode_").removesuffix("_total"): int(sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name.startswith("pagedkv:spec_decode_num_") and "_per_pos" not in sample.name
    }
    if not counted["num_drafts"]:  # this machine's timings made no draft pay
        assert "pagedkv serve: since start, speculative decoding: no drafts verified" in output
        return
    line = re.search(
        r"pagedkv serve: since start, speculative decoding: (\d+) verifications of (\d+) "
        r"drafted tokens; acceptance rate ([\d.]+)%",
        output,
    )
    assert line is not None, output
    assert (int(line[1]), int(line[2])) == (counted["num_drafts"], counted["num_draft_tokens"])
    rate = counted["num_accepted_tokens"] / counted["num_draft_tokens"]
    assert line[3] == f"{rate:.1%}".rstrip("%")


def test_disable_uvicorn_access_log_leaves_requests_unlogged(tiny_model: Path) -> None:
    server, url = start_serve(tiny_model, "--disable-uvicorn-access-log")
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        response = httpx2.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert response.status_code == 200
    finally:
        output = stop_serve(server)
    assert "Uvicorn running" in output or "Application startup complete" in output
    assert "HTTP/1.1" not in output, output


def test_behind_a_proxy_path_prefix_the_page_map_and_redirects_resolve(tiny_model: Path) -> None:
    """A reverse proxy serves the server under /llm and strips the prefix: the browser's URLs,
    resolved against the page's /llm/ as URL resolution does, must reach the server once
    stripped, and a redirect must point back under /llm."""
    server, url = start_serve(tiny_model, "--root-path", "llm/", "--api-key", "secret")  # /llm
    key = {"Authorization": "Bearer secret"}
    try:
        page = httpx2.get(f"{url}/", timeout=HANG_GUARD_S).text
        script = httpx2.get(f"{url}/static/pagemap.js", timeout=HANG_GUARD_S).text
        links = re.findall(r'(?:href|src)="([^"]+)"', page) + re.findall(
            r'fetch\("([^"]+)"', script
        )
        assert {"css", "js", "stream"} <= {
            link.rsplit("/", 1)[-1].rsplit(".", 1)[-1] for link in links
        }
        for link in links:
            seen = urllib.parse.urljoin("https://proxy.example/llm/", link)
            if not seen.startswith("https://proxy.example/"):
                continue  # data: URLs
            path = urllib.parse.urlsplit(seen).path
            assert path.startswith("/llm/"), f"{link} leaves the proxy's prefix"
            stripped = url + path.removeprefix("/llm")
            with httpx2.stream("GET", stripped, headers=key, timeout=HANG_GUARD_S) as got:
                assert got.status_code == 200, link
        for path in ("/v1/models/", "/health/"):  # redirected to the path without its "/"
            moved = httpx2.get(url + path, headers=key, timeout=HANG_GUARD_S)
            assert moved.status_code in (307, 308)
            assert urllib.parse.urlsplit(moved.headers["location"]).path == "/llm" + path[:-1]
        for path in ("/v1/models", "/v1/kv", "/tokenize"):  # the key still guards them
            assert httpx2.get(url + path, timeout=HANG_GUARD_S).status_code == 401, path
            assert httpx2.get(url + path, headers=key, timeout=HANG_GUARD_S).status_code != 401
    finally:
        stop_serve(server)
