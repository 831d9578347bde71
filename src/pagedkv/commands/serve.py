"""`pagedkv serve`: the OpenAI-compatible server with the live KV page map, under uvicorn.

Binds to 127.0.0.1 unless told otherwise: the API has no per-user limits, so exposing it is
a decision the user makes with `--host` (and should pair with `--api-key`). The port is bound
before the model loads, as vLLM binds it: a port in use fails at once, not after a load.
SIGINT and SIGTERM drain the server (see `pagedkv.server.drain`) and exit 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from pagedkv.commands.arguments import (
    KeysAction,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    string_list,
)
from pagedkv.commands.serve_chat import add_chat_arguments, chat_template_text

if TYPE_CHECKING:
    from pagedkv.server import ServerConfig
    from pagedkv.server.adapters import LoRAModulePath

API_KEY_ENV = "PAGEDKV_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # a ported deployment's key is still required
DEFAULT_MAX_WAITING = 512
LOOPBACK_ADDRESSES = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options (the same flags as `generate` and `bench`) plus the server's own."""
    from pagedkv.engine import EngineArgs
    from pagedkv.engine.metrics import DEFAULT_PREFIX, PREFIXES
    from pagedkv.server import ServerConfig
    from pagedkv.server.tls import CERT_REQS

    defaults = ServerConfig()
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (instead of --model; wins over it)",
    )
    EngineArgs.add_cli_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    server.add_argument("--port", type=port, default=8000, help="port (default: %(default)s)")
    environment_key = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV)
    server.add_argument(
        "--api-key",
        action=KeysAction,
        metavar="KEY",
        default=[environment_key] if environment_key else None,
        help=f"require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize; repeat it "
        f"for several keys, any one accepted (vLLM's list) (default: ${API_KEY_ENV}, else "
        f"vLLM's ${VLLM_API_KEY_ENV})",
    )
    server.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this certificate (PEM; it may hold the key too), as vLLM's",
    )
    server.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)"
    )
    server.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="CA certificates that client certificates are checked against (PEM)",
    )
    server.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=sorted(CERT_REQS),
        default=0,
        help="client certificates: "
        + ", ".join(f"{value} {name}" for value, name in sorted(CERT_REQS.items()))
        + " (Python's ssl numbers, as vLLM's; default: %(default)s)",
    )
    server.add_argument(
        "--max-waiting",
        type=positive_int,
        default=DEFAULT_MAX_WAITING,
        help="answer 503 + Retry-After once this many requests wait beyond the batch's free "
        "seats (--max-num-seqs) (default: %(default)s)",
    )
    server.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse requests with unknown fields (400) instead of ignoring them with a log line",
    )
    server.add_argument(
        "--metrics-prefix",
        choices=PREFIXES,
        default=DEFAULT_PREFIX,
        help="name /metrics as '<prefix>:...'; 'vllm' suits vLLM's dashboards (default: "
        "%(default)s)",
    )
    server.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="answer only requests whose Host header names one of these (any port), against "
        "DNS rebinding (default: localhost 127.0.0.1 [::1] when --host is loopback, else any)",
    )
    server.add_argument(
        "--allowed-origins",
        type=string_list,
        default=list(defaults.allowed_origins),
        metavar="JSON",
        help="origins whose web pages may call the API (CORS), a JSON list as vLLM's, e.g. "
        "'[\"https://ui.example\"]' or '[\"*\"]'; none by default (vLLM's is any: a "
        "server answering any origin lets any page the user opens drive it)",
    )
    server.add_argument(
        "--allowed-methods",
        type=string_list,
        default=list(defaults.allowed_methods),
        metavar="JSON",
        help="methods those pages may use (default: %(default)s)",
    )
    server.add_argument(
        "--allowed-headers",
        type=string_list,
        default=list(defaults.allowed_headers),
        metavar="JSON",
        help="headers those pages may send (default: %(default)s)",
    )
    server.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let those pages send cookies and HTTP authentication (CORS credentials)",
    )
    server.add_argument(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        help="open connections at most; more are closed as they open (lowered to fit "
        "`ulimit -n` if need be; default: %(default)s)",
    )
    server.add_argument(
        "--request-read-timeout",
        type=positive_float,
        default=defaults.request_read_timeout,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request (headers and body) "
        "this long after the server began reading it (default: %(default)s)",
    )
    server.add_argument(
        "--max-page-map-viewers",
        type=positive_int,
        default=defaults.max_page_map_viewers,
        help="page-map streams at once; more get 503 (default: %(default)s)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=defaults.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, refuse new requests and let running ones finish for this "
        "long, then end them with an error (default: %(default)s)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, each chosen by its NAME as `model` "
        '(needs --enable-lora); or, as vLLM\'s, \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\', the base model /v1/models lists as its parent',
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which turns them on too)",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients pass as `model`, as vLLM's: every one is answered, the first "
        "is the one responses report (default: the --model argument)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice 'auto'; accepted: tool calls are always read here "
        "(Hermes style, <tool_call>{...}</tool_call>)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=("hermes",),
        default="hermes",
        help="how tool calls are read from the output: vLLM's 'hermes' parser, the one "
        "here (default: %(default)s)",
    )
    server.add_argument(
        "--enable-log-requests",
        "--disable-log-requests",
        dest="log_requests",
        action="store_true",
        help="vLLM's request logging switches; accepted: requests' contents are never logged "
        "here (only their fields the server ignores)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default="info",
        help="uvicorn's log level (default: %(default)s)",
    )
    server.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a reverse proxy serves this server under and strips (e.g. /llm): "
        "redirects then carry it (vLLM's flag; unlike vLLM's, paths that still carry the "
        "prefix are not routed: the proxy must strip it)",
    )
    server.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="log no line per HTTP request (uvicorn's access log), as vLLM's",
    )
    add_chat_arguments(server, defaults)


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    from pagedkv.engine import Engine, EngineArgs
    from pagedkv.engine.args import flag_error
    from pagedkv.engine.errors import STARTUP_ERRORS
    from pagedkv.model.errors import ChatTemplateError
    from pagedkv.server import build_app, build_server
    from pagedkv.server.errors import APIError
    from pagedkv.server.tls import TLSConfigError, TLSFiles

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.host not in LOOPBACK_ADDRESSES and not args.api_key:  # (keys are never empty)
        print(f"warning: serving on {args.host} without --api-key", file=sys.stderr)
    if args.lora_modules and not args.enable_lora:
        print("pagedkv serve: error: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        try:
            args.chat_template = chat_template_text(args.chat_template)
        except (OSError, ValueError, ChatTemplateError) as error:
            print(f"pagedkv serve: error: --chat-template: {error}", file=sys.stderr)
            return 2
    tls = TLSFiles(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    try:
        tls = tls.check()
    except TLSConfigError as error:
        print(f"pagedkv serve: error: {error}", file=sys.stderr)
        return 2
    try:
        listening = bound_socket(args.host, args.port)
    except OSError as error:
        print(
            f"pagedkv serve: error: cannot listen on {args.host} port {args.port}: "
            f"{error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    with listening:
        try:
            engine = Engine(EngineArgs.from_cli_args(args))
        except STARTUP_ERRORS as error:
            print(f"pagedkv serve: error: {flag_error(error)}", file=sys.stderr)
            return 2
        try:
            app = build_app(engine, server_config(args))
        except APIError as error:  # a --lora-modules adapter that cannot be served
            print(f"pagedkv serve: error: {error}", file=sys.stderr)
            engine.shutdown()
            return 2
        port_bound = listening.getsockname()[1]  # --port 0: the port the system chose
        scheme = "https" if tls.enabled else "http"
        print(f"page map: {scheme}://{args.host}:{port_bound}/", file=sys.stderr)
        server = build_server(
            app,
            host=args.host,
            port=port_bound,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            root_path=("/" + args.root_path.strip("/")).rstrip("/"),  # "/llm/", "llm": "/llm"
            **tls.uvicorn_options(),
        )
        try:
            server.run(sockets=[listening])
            spec = engine.stats.spec_decoding
            if spec.enabled:  # the figures /metrics counted, once more as one line
                print(f"pagedkv serve: since start, {spec.describe()}", file=sys.stderr)
        finally:
            engine.shutdown()  # ends the tensor-parallel workers, if any
    return 0 if server.started else 1


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host` and `port` as uvicorn binds its own (IPv6 when the host has
    a colon, else IPv4, so "localhost" is 127.0.0.1); the server listens on it once the model
    is loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from the command line; a loopback-bound server answers only to
    the loopback names unless `--allowed-hosts` says otherwise."""
    from pagedkv.server import ServerConfig
    from pagedkv.server.header_guard import LOOPBACK_HOSTS

    allowed_hosts = args.allowed_hosts
    if allowed_hosts is None and args.host in LOOPBACK_ADDRESSES:
        allowed_hosts = LOOPBACK_HOSTS
    return ServerConfig(
        model_name=args.served_model_name[0] if args.served_model_name else None,
        model_aliases=tuple(args.served_model_name[1:] if args.served_model_name else ()),
        api_key=tuple(args.api_key) if args.api_key else None,
        max_waiting=args.max_waiting,
        strict_fields=args.strict_fields,
        metrics_prefix=args.metrics_prefix,
        allowed_hosts=None if allowed_hosts is None else tuple(allowed_hosts),
        max_connections=args.max_connections,
        request_read_timeout=args.request_read_timeout,
        max_page_map_viewers=args.max_page_map_viewers,
        shutdown_timeout=args.shutdown_timeout,
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )


def lora_module(text: str) -> LoRAModulePath:
    """`--lora-modules`' NAME=PATH, or vLLM's JSON object."""
    from pagedkv.server.adapters import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
