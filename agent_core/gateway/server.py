"""The gateway's HTTP face: an OpenAI-compatible server on 127.0.0.1, run in a background thread.

    with Gateway(engine, tokenizer, sampling, limits, chat) as gateway:
        token = gateway.open_episode("ep-0")      # the agent's OPENAI_API_KEY
        ...  # the agent calls f"{gateway.base_url}/chat/completions"
        calls = gateway.finish_episode(token)     # the episode's calls; its token is refused from now on

Endpoints: `POST /v1/chat/completions`, `/v1/responses` (OpenAI's Responses API) and `/v1/messages`
(Anthropic's), each also streamed, and `GET /v1/models`, over one recording per episode. A request
needs its episode's token (`Authorization: Bearer` or `x-api-key`), else 401; `X-AgentR1-Agent`
(or the body's `user`) names the program's agent; a body over `max_body_bytes` is 413, a throttled
episode 429 (core.py bounds a request's cost before tokenizing); any error is one line. No endpoint
returns recorded calls. Bound to 127.0.0.1, a free port, and to a Unix socket (`unix_socket`) where a
jailed program's loopback is forwarded (envs/program_jail.py). Design: docs/architecture.md §6.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import anyio.from_thread
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from agent_core.envs.tool_env import ChatCapabilities
from agent_core.gateway import messages_format, responses_format
from agent_core.gateway.core import CLIENT_GONE, EpisodeCalls, GatewayCore, GatewayError, GatewayLimits
from agent_core.gateway.chat_replies import completion_body, completion_chunks
from agent_core.gateway.openai_format import (
    ChatRequest, Completion, RequestError, agent_name, check_json, error_body, parse_request,
)
from agent_core.rollout.engine import Engine, SamplingParams

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
AGENT_HEADER = "x-agentr1-agent"  # which of the program's agents makes a call (schemas/steps.py `agent`)
DEFAULT_MAX_BODY_BYTES = 4_000_000
_CONVERSATION_LISTS = ("messages", "input", "tools")  # each API's conversation and tools, item by item
_START_TIMEOUT_S = 30.0


class _BodyTooLarge(Exception):
    pass


def build_app(core: GatewayCore, max_body_bytes: int) -> FastAPI:
    """The FastAPI app over `core` (module docstring)."""
    app = FastAPI(title="agentr1 gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def token_of(request: Request) -> str | None:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        token = bearer.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        return token if token and core.is_open(token) else None

    async def serve(request: Request, to_chat: Callable[[Any], ChatRequest],
                    reply: Callable[[Completion, ChatRequest], Response], anthropic: bool = False) -> Response:
        """Authenticate, then `answer`; any failure is one line (module docstring)."""
        refuse = _refusal(anthropic)
        token = token_of(request)
        if token is None:
            return refuse(401, "unknown or finished episode token (OPENAI_API_KEY)", "invalid_api_key")
        if core.throttled(token):
            return refuse(429, f"this episode's requests were refused {core.limits.max_refused} times; "
                               "the gateway refuses the rest", "too_many_refused_requests")

        def refuse_counted(status: int, message: str, code: str) -> Response:
            if status in (400, 413):
                core.note_refused(token)
            return refuse(status, message, code)
        try:
            return await answer(request, token, to_chat, reply, refuse_counted)
        except Exception as error:  # noqa: BLE001 - whatever a body triggers, one line: a log is no flood
            line = (str(error).splitlines() or [""])[0][:200]
            log.warning("gateway: %s failed with %s: %s", request.url.path, type(error).__name__, line)
            log.debug("gateway failure", exc_info=True)
            return refuse(500, f"the gateway failed on this request ({type(error).__name__})", "internal_error")

    async def answer(request: Request, token: str, to_chat: Callable[[Any], ChatRequest],
                     reply: Callable[[Completion, ChatRequest], Response],
                     refuse: Callable[[int, str, str], Response]) -> Response:
        """Read, check and convert the body, complete it under the episode's token, format the reply."""
        try:
            raw = await _read_body(request, max_body_bytes)
        except _BodyTooLarge:
            return refuse(413, f"request body over the gateway's limit of {max_body_bytes} bytes", "request_too_large")
        try:
            chat_request = _chat_request(core, token, raw, to_chat, request.headers.get(AGENT_HEADER))
        except (ValueError, RecursionError) as error:  # RequestError is a ValueError; so is bad JSON
            message = str(error) if isinstance(error, RequestError) else f"the body is not valid JSON: {error}"
            return refuse(400, message.splitlines()[0] if message else "bad request", "invalid_request")
        except GatewayError as error:
            return refuse(error.status, str(error), error.code)

        def gone() -> bool:  # asked on the worker thread once the reply is generated; answered on the loop
            return anyio.from_thread.run(request.is_disconnected)
        try:
            completion = await run_in_threadpool(core.complete, token, chat_request, gone)
        except GatewayError as error:
            if error.status == CLIENT_GONE:
                log.info("gateway: a client disconnected before its reply; the call is not recorded")
                return Response(status_code=CLIENT_GONE)
            return refuse(error.status, str(error), error.code)
        return reply(completion, chat_request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if token_of(request) is None:
            return _refusal(False)(401, "unknown or finished episode token (OPENAI_API_KEY)", "invalid_api_key")
        return JSONResponse({"object": "list", "data": [
            {"id": core.model_name, "object": "model", "created": 0, "owned_by": "agentr1"}]})

    def chat_reply(completion: Completion, chat: ChatRequest) -> Response:
        if not chat.stream:
            return JSONResponse(completion_body(completion, core.model_name, chat.logprobs))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in
                  completion_chunks(completion, core.model_name, chat.include_usage, chat.logprobs)]
        return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, parse_request, chat_reply)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(request, responses_format.chat_request,
                           _replier(responses_format.response_body, responses_format.response_events, core.model_name))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve(request, messages_format.chat_request,
                           _replier(messages_format.message_body, messages_format.message_events, core.model_name),
                           anthropic=True)

    return app


def _chat_request(core: GatewayCore, token: str, raw: bytes, to_chat: Callable[[Any], ChatRequest],
                  named: str | None) -> ChatRequest:
    """The request in body `raw`: parsed (NaN and Infinity are not JSON), its conversation's length checked
    against the context before any per-item work (`GatewayCore.check_items`), checked, converted."""
    body = json.loads(raw, parse_constant=_not_json)
    if isinstance(body, dict):
        core.check_items(token, sum(len(body[key]) for key in _CONVERSATION_LISTS if isinstance(body.get(key), list)))
    check_json(body)
    chat_request = to_chat(body)
    return chat_request if named is None else replace(chat_request, agent=agent_name(named))


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


def _replier(body_of: Callable[[Completion, ChatRequest, str], dict], events_of: Callable[[dict], list[dict]],
             model: str) -> Callable[[Completion, ChatRequest], Response]:
    """An API's reply: its body, or the body's events when the request streams."""
    def reply(completion: Completion, chat: ChatRequest) -> Response:
        body = body_of(completion, chat, model)
        return _events(events_of(body)) if chat.stream else JSONResponse(body)
    return reply


def _events(events: list[dict]) -> StreamingResponse:
    """Server-sent events, each named by its type (the Responses and Messages APIs' streams)."""
    return StreamingResponse(iter([f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]),
                             media_type="text/event-stream")


def _refusal(anthropic: bool) -> Callable[[int, str, str], JSONResponse]:
    """An error response in the API's own shape (OpenAI's, or Anthropic's for /v1/messages)."""
    def refuse(status: int, message: str, code: str) -> JSONResponse:
        kinds = {401: "authentication_error", 429: "rate_limit_error", 500: "api_error"}
        kind = kinds.get(status, "invalid_request_error")
        body = {"type": "error", "error": {"type": kind, "message": message}} if anthropic \
            else error_body(message, kind, code)
        return JSONResponse(body, status_code=status)
    return refuse


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused past `limit` bytes: by its declared length at once, else as it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


class Gateway:
    """The gateway server over `engine` for the length of a `with` block (module docstring)."""

    def __init__(self, engine: Engine, tokenizer, sampling: SamplingParams, limits: GatewayLimits,
                 chat: ChatCapabilities | None = None, *, model_name: str = "policy",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.core = GatewayCore(engine, tokenizer, sampling, limits, chat or ChatCapabilities(), model_name)
        self.max_body_bytes = max_body_bytes
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self._socket_dir: str | None = None

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url (OPENAI_BASE_URL)."""
        return f"{self.root_url}/v1"

    @property
    def root_url(self) -> str:
        """What an Anthropic client takes as base_url (ANTHROPIC_BASE_URL): it adds /v1/messages itself."""
        if self.port is None:
            raise RuntimeError("the gateway is not running; use it as a context manager")
        return f"http://{HOST}:{self.port}"

    @property
    def unix_socket(self) -> str:
        """The gateway's Unix socket: where a jailed program's port is forwarded (program_jail.py)."""
        if self._socket_dir is None:
            raise RuntimeError("the gateway is not running; use it as a context manager")
        return os.path.join(self._socket_dir, "gateway.sock")

    def open_episode(self, episode_id: str) -> str:
        return self.core.open_episode(episode_id)

    def program_started(self, token: str) -> None:
        self.core.program_started(token)

    def finish_episode(self, token: str) -> EpisodeCalls:
        return self.core.finish_episode(token)

    def __enter__(self) -> "Gateway":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        # the same app on a Unix socket: a jailed program's own network namespace forwards the port here
        self._socket_dir = tempfile.mkdtemp(prefix="agentr1-gateway-")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(os.path.join(self._socket_dir, "gateway.sock"))
        config = uvicorn.Config(build_app(self.core, self.max_body_bytes), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=([sock, unix],), name="agentr1-gateway",
                                        daemon=True)
        self._thread.start()
        self._wait_started()
        log.info("gateway listening on %s", self.base_url)
        return self

    def _serve(self, sockets: list[socket.socket]) -> None:
        asyncio.run(self._server.serve(sockets=sockets))

    def _wait_started(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the gateway did not start on {HOST}:{self.port} within {_START_TIMEOUT_S:g} s")

    def __exit__(self, *exc_info) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_START_TIMEOUT_S)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self.port = self._socket_dir = None
