"""The FastAPI app: OpenAI routes, metrics, health and the page map, around one EngineLoop.

`build_app(engine, config)` returns an app whose lifespan starts the engine thread and stops
it (aborting whatever is in flight) on shutdown; `http_server.build_server(app)` serves it,
draining first. With `config.api_key` every `/v1` route needs `Authorization: Bearer KEY`;
`/`, `/static`, `/health` and `/metrics` stay open, as in vLLM, so probes and scrapers need
no secret (the page asks for the key itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.staticfiles import StaticFiles

from pagedkv.engine.lora import LoRARejected
from pagedkv.engine.metrics import CONTENT_TYPE, DEFAULT_PREFIX, EngineMetrics
from pagedkv.engine.token_bytes import TokenBytes
from pagedkv.server import connections, page_map
from pagedkv.server.adapters import (
    LoRAModulePath,
    ServedAdapters,
    rejected,
    runtime_updating_allowed,
)
from pagedkv.server.chat import create_chat_completion
from pagedkv.server.completions import create_completion
from pagedkv.server.drain import SHUTDOWN_TIMEOUT_S, Drain
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import APIError, install_error_handlers
from pagedkv.server.generation import ARRIVAL_TIME
from pagedkv.server.header_guard import HeaderGuard
from pagedkv.server.limits import BodyLimit
from pagedkv.server.responses import ModelCard, ModelList
from pagedkv.server.responses_api import (
    cancel_response,
    create_response,
    delete_response,
    retrieve_response,
)
from pagedkv.server.serving import ServingContext, now, shutting_down
from pagedkv.server.tokenize import detokenize, tokenize

if TYPE_CHECKING:
    from pagedkv.engine import Engine

STATIC_DIR = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServerConfig:
    """Server options that are not engine options."""

    model_name: str | None = None  # the name clients pass as `model`; default: the engine's
    model_aliases: tuple[str, ...] = ()  # other names answered for it (listed, never reported)
    api_key: str | tuple[str, ...] | None = None  # several: any one of them (vLLM's)
    max_waiting: int | None = None  # 503 + Retry-After once this many requests wait
    strict_fields: bool = False  # unknown request fields: 400 instead of a log line
    metrics_prefix: str = DEFAULT_PREFIX  # "vllm": metric names exactly as vLLM's
    allowed_hosts: tuple[str, ...] | None = None  # Host names answered (any port); None: any
    max_connections: int = connections.MAX_CONNECTIONS  # more are closed as they open
    request_read_timeout: float = connections.REQUEST_READ_TIMEOUT_S  # s to send a request
    max_page_map_viewers: int = page_map.MAX_VIEWERS  # more get 503
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S  # s running requests may go on when stopping
    lora_modules: tuple[LoRAModulePath, ...] = ()  # adapters served from the start
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and unload
    chat_template: str | None = None  # replaces the model's; a request's replaces this one
    chat_template_content_format: str = "auto"  # vLLM's: "string", "openai" or "auto"
    # A request's own chat_template rendered (vLLM's --trust-request-chat-template): a template
    # is a program, and a crafted one can take the server's memory and CPU.
    trust_request_chat_template: bool = False
    response_role: str = "assistant"  # vLLM's --response-role
    reasoning_parser: str | None = None  # vLLM's: a thinking model's reasoning told apart
    # Origins whose web pages may call the API (CORS); none by default, unlike vLLM's "*": a
    # local server answering any origin lets any page the user opens drive it.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def build_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """The whole server around `engine`; the engine thread runs while the app is up."""
    config = config or ServerConfig()
    model_name = config.model_name or engine.model_name
    engine_loop = EngineLoop(engine, max_waiting=config.max_waiting)
    metrics = EngineMetrics(
        model_name, lambda: engine_loop.stats, engine.max_model_len, config.metrics_prefix
    )
    engine_loop.metrics = metrics
    adapters = ServedAdapters(model_name, config.model_aliases)
    for module in config.lora_modules:  # a bad one stops the start, naming it
        lora = adapters.new(module.name, module.path, module.base_model_name)
        try:
            engine.add_lora(lora)  # the engine thread is not running yet
        except LoRARejected as error:
            raise rejected(error) from None
        adapters.serve(lora)
    context = ServingContext(
        engine_loop=engine_loop,
        tokenizer=engine.tokenizer,
        token_bytes=TokenBytes(engine.tokenizer),
        model_name=model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.config.vocab_size,
        max_logprobs=engine.max_logprobs,
        system_fingerprint=f"pagedkv-{version('pagedkv')}",
        adapters=adapters,
        sampling_defaults=engine.sampling_defaults,
        strict_fields=config.strict_fields,
        chat_template=config.chat_template,
        chat_template_content_format=config.chat_template_content_format,
        trust_request_chat_template=config.trust_request_chat_template,
        response_role=config.response_role,
        reasoning_parser=config.reasoning_parser,
    )
    started = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(
        title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    feed = page_map.PageMapFeed(engine_loop, config.max_page_map_viewers)
    app.state.engine_loop = engine_loop
    app.state.config = config
    app.state.drain = Drain(engine_loop, feed)
    app.add_middleware(BodyLimit)
    # Added last, so outermost: it refuses on the headers before BodyLimit reads any body.
    app.add_middleware(
        HeaderGuard,
        api_key=config.api_key,
        allowed_hosts=config.allowed_hosts,
        router=app.router,  # its routes, added below, are read per request
    )
    if config.allowed_origins:
        # Outermost: a browser's preflight carries no API key, so it is answered here, and the
        # refusals inside still carry the headers a page needs to read them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        ARRIVAL_TIME.set(time.monotonic())
        return await create_completion(context, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ARRIVAL_TIME.set(time.monotonic())
        return await create_chat_completion(context, request)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        ARRIVAL_TIME.set(time.monotonic())
        return await create_response(context, request)

    @v1.get("/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return retrieve_response(context, response_id)

    @v1.delete("/responses/{response_id}")
    async def forget_response(response_id: str) -> Response:
        return delete_response(context, response_id)

    @v1.post("/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        return cancel_response(context, response_id)

    base = [  # vLLM's root: the model as the engine was given it (a path or a Hub name)
        ModelCard(
            id=name, created=started, max_model_len=engine.max_model_len, root=engine.args.model
        )
        for name in (model_name, *config.model_aliases)
    ]

    def cards() -> list[ModelCard]:
        """The base model under each of its names, then each served LoRA adapter (vLLM's
        `root` and `parent`)."""
        return base + [
            ModelCard(
                id=name,
                created=started,
                max_model_len=engine.max_model_len,
                root=lora.lora_path,
                parent=lora.base_model_name or model_name,
            )
            for name, lora in adapters.by_name.items()
        ]

    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=cards()).model_dump(exclude_none=True))

    @v1.get("/models/{model_id:path}")  # a path: served names are often "org/model"
    async def model(request: Request, model_id: str) -> Response:
        if not model_id:  # "/v1/models/": FastAPI's trailing-slash redirect, as vLLM answers
            return RedirectResponse(request.url.replace(path=request.url.path.rstrip("/")))
        context.check_model(model_id)
        found = next(c for c in cards() if c.id == model_id)
        return JSONResponse(found.model_dump(exclude_none=True))

    if runtime_updating_allowed(config.allow_runtime_lora_updating):

        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            body = await _json_object(request)
            lora = adapters.new(body.get("lora_name"), body.get("lora_path"))
            try:
                await engine_loop.call(lambda engine: engine.add_lora(lora))
            except LoRARejected as error:
                raise rejected(error) from None
            adapters.serve(lora)
            return PlainTextResponse(
                f"Success: LoRA adapter '{lora.lora_name}' added successfully."
            )

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            name = (await _json_object(request)).get("lora_name")
            lora = adapters.remove(name)
            # Its weights and blocks go now, or when the requests running with it finish.
            await engine_loop.call(lambda engine: engine.remove_lora(lora.lora_int_id))
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @v1.get("/kv")
    async def kv() -> Response:
        return Response(await page_map.snapshot_json(engine_loop), media_type="application/json")

    @v1.get("/kv/stream")
    async def kv_stream() -> Response:
        return feed.stream_response()

    app.include_router(v1)

    if engine.profiler.enabled:  # vLLM's, served when a profiler is configured

        @app.post("/start_profile")
        async def start_profile() -> Response:
            await engine_loop.call(lambda engine: engine.profiler.start())
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            await engine_loop.call(lambda engine: engine.profiler.stop())
            return Response(status_code=200)

    @app.post("/tokenize")  # vLLM's, outside /v1 as there
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(context, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(context, request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's probe)
    async def health() -> JSONResponse:
        failure = engine_loop.health_failure()
        if failure is not None:
            return APIError(503, failure, type="server_error").response()
        if engine_loop.draining:
            return shutting_down("server shutting down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")  # vLLM's: the server's version, open like /health
    async def server_version() -> JSONResponse:
        return JSONResponse({"version": version("pagedkv")})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


async def _json_object(request: Request) -> dict:
    """The request's body as a JSON object; a 400 otherwise."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body
