"""The page map in a real headless browser: Debian's chromium driven by playwright.

Playwright's own browser download is not reachable here, so the test drives the system
chromium through `executable_path`. A missing browser is a failure that says what to install,
not a skip: a skipped test would hide that the page was never checked.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from tests.server.conftest import HANG_GUARD_S, RunningServer, all_blocks_free

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NUM_GPU_BLOCKS = 12_000  # past 10,000: the page must stay smooth on a canvas
NUM_REQUESTS = 4
WAIT_MS = HANG_GUARD_S * 1000  # playwright's waits end when their condition holds


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=16)


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; "
            "`make test` does this when run as root) to check the page map in a browser"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        yield browser
        browser.close()


def test_page_map_draws_the_pool_follows_requests_and_names_owners_on_hover(
    server: RunningServer, browser, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []  # the browser console's, a 404 for a favicon among them
    page.on(
        "console", lambda message: errors.append(message.text) if message.type == "error" else None
    )
    page.goto(server.url + "/")
    page.wait_for_function("Number(document.body.dataset.frames) >= 1", timeout=WAIT_MS)
    assert page.evaluate("pagemap.gpu.blocks.length") == NUM_GPU_BLOCKS
    assert page.evaluate("pagemap.gpu.heldBlocks().length") == 0
    assert page.locator("#kv-dtype").inner_text().startswith("float32 · ")
    # Smooth at this size means drawn on a canvas, not an element per block.
    assert page.evaluate("document.querySelectorAll('*').length") < NUM_GPU_BLOCKS / 100
    idle = page.locator("#gpu").screenshot()

    request_ids: list[str] = []
    stop = threading.Event()
    workers = [
        threading.Thread(target=_stream, args=(server, i, request_ids, stop))
        for i in range(NUM_REQUESTS)
    ]
    for worker in workers:
        worker.start()
    try:
        page.wait_for_function("pagemap.gpu.heldBlocks().length > 8", timeout=WAIT_MS)
        assert page.locator("#gpu").screenshot() != idle
        assert page.locator("#kv-usage").inner_text() != "0.0%"

        block = page.evaluate("pagemap.gpu.heldBlocks()[0]")
        centre = page.evaluate(f"pagemap.gpu.blockCentre({block})")
        page.mouse.move(centre["x"], centre["y"])
        tooltip = page.locator("#tooltip")
        tooltip.wait_for(state="visible", timeout=WAIT_MS)
        text = tooltip.inner_text()
        assert f"GPU block {block}" in text and "ref count" in text and "prefix cache" in text
        assert any(request_id in text for request_id in request_ids), text
        page.screenshot(path=str(tmp_path / "pagemap.png"))
    finally:
        stop.set()  # the clients hang up: their requests are aborted and their blocks freed
        for worker in workers:
            worker.join(timeout=HANG_GUARD_S)
    page.wait_for_function("pagemap.gpu.heldBlocks().length === 0", timeout=WAIT_MS)
    assert all_blocks_free(server)
    assert errors == []  # seconds after the load: a favicon's 404 would be in by now
    page.close()


def _stream(
    server: RunningServer, index: int, request_ids: list[str], stop: threading.Event
) -> None:
    """A long streamed completion (n=2 on odd ones, so blocks are shared) until `stop`."""
    with server.client() as client:
        stream = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=f"Request {index}: " + "Paged attention stores keys and values. " * 12,
            max_tokens=600,  # the prompt is ~350 tokens of the 1024 the tiny model allows
            n=1 + index % 2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with stream:
            for chunk in stream:
                if chunk.id not in request_ids:
                    request_ids.append(chunk.id)
                if stop.is_set():
                    break


def test_page_assets_are_served_from_the_package(server: RunningServer) -> None:
    with server.http() as http:
        index = http.get("/")
        assert index.status_code == 200 and '<canvas id="gpu">' in index.text
        for asset in ("/static/pagemap.js", "/static/pagemap.css"):
            assert http.get(asset).status_code == 200


def test_page_map_draws_the_host_tier_and_its_hits(serve, browser) -> None:
    """With --kv-offloading-size, the page shows the host tier: blocks the GPU pool evicted,
    and a block copied back to the GPU drawn as a hit in the frame after it."""
    tiered = serve(num_gpu_blocks=6, kv_offloading_size=0.01)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(tiered.url + "/")
    page.wait_for_function("Number(document.body.dataset.frames) >= 1", timeout=WAIT_MS)
    assert page.locator("#offload-pool").is_visible()
    num_offload = page.evaluate("pagemap.offload.blocks.length")
    assert num_offload > 0
    page.evaluate(
        "window.sawHit = false; setInterval(() => {"
        " if (pagemap.offload.blocks.some((b) => b[1] === 2)) window.sawHit = true; }, 5)"
    )
    with tiered.client() as client:
        name = client.models.list().data[0].id
        first = [5 + i % 50 for i in range(60)]
        others = [[7 + (i * k) % 40 for i in range(60)] for k in (1, 3)]
        for prompt in (first, *others, first):
            client.completions.create(model=name, prompt=prompt, max_tokens=1)
    page.wait_for_function("window.sawHit", timeout=WAIT_MS)
    page.wait_for_function("pagemap.offload.blocks.some((b) => b[1] === 1)", timeout=WAIT_MS)
    page.close()


def test_page_map_draws_lora_adapters_with_their_names(serve, browser, tiny_model, tmp_path):
    """An adapter's blocks of the pool are drawn as its own, and hovering one names it."""
    from pagedkv.server import ServerConfig
    from pagedkv.server.adapters import LoRAModulePath
    from tests.server.test_lora_server import make_adapter

    folder = make_adapter(tiny_model, tmp_path / "sql", 3, ["q_proj", "down_proj"])
    config = ServerConfig(lora_modules=(LoRAModulePath("sql", str(folder)),))
    lora = serve(config, enable_lora=True, num_gpu_blocks=256)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(lora.url + "/")
    page.wait_for_function("Number(document.body.dataset.frames) >= 1", timeout=WAIT_MS)
    assert page.evaluate("pagemap.gpu.adapters.size") == 0
    with lora.client() as client:
        client.completions.create(model="sql", prompt="Paged attention", max_tokens=2)
    page.wait_for_function("pagemap.gpu.adapters.size > 0", timeout=WAIT_MS)
    block = page.evaluate("[...pagemap.gpu.adapters.keys()][0]")
    centre = page.evaluate(f"pagemap.gpu.blockCentre({block})")
    page.mouse.move(centre["x"], centre["y"])
    tooltip = page.locator("#tooltip")
    tooltip.wait_for(state="visible", timeout=WAIT_MS)
    assert "LoRA adapter sql" in tooltip.inner_text()
    page.close()
