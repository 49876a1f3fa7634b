"""The HTTP side: Starlette routes that turn OpenAI requests into `Job`s for the model worker and
its events into JSON or server-sent events. Nothing here touches MLX.

Every error, a malformed body as much as an unknown route, is answered in OpenAI's error shape.
A client that goes away stops its job: while the job waits or runs a watcher sees the
disconnect; once a stream is under way Starlette cancels it, and the stream's cleanup cancels
the job, whose caches the worker then drops.
"""

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mlx_hybrid.generation_config import model_sampling_defaults
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.server.engine import Engine, Failed, Finished, Job, Started
from mlx_hybrid.server.protocol import ApiError, ChatRequest, CompletionRequest, Reply, parse


class Gone(Exception):
    """The client disconnected before its answer was ready."""


class Channel:
    """A job's events, sent from the worker thread, read on the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, event):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is stopping
            pass


def create_app(engine: Engine, model_id: str, default_temp: float | None = None) -> Starlette:
    """The ASGI app serving engine's model under the id model_id. A field a request leaves out
    takes the model's generation_config.json value (`mlx_hybrid.generation_config`), the
    temperature default_temp if given, else the file's, else OpenAI's 1."""
    created = int(time.time())

    def defaults() -> SamplingParams:
        model_defaults = model_sampling_defaults(engine.loaded.model)
        temp = default_temp if default_temp is not None else model_defaults.values.get("temp", 1.0)
        return model_defaults.params(temp=temp)

    def check_model(name: str):
        if name != model_id:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{model_id}'", "model", "model_not_found")

    async def chat_completions(request: Request):
        req = parse(ChatRequest, await _json(request))
        check_model(req.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        channel = Channel()
        job = _job(req, channel, messages=messages)
        return await _respond(request, engine, job, channel, Reply(True, model_id), req)

    async def completions(request: Request):
        req = parse(CompletionRequest, await _json(request))
        check_model(req.model)
        channel = Channel()
        job = _job(req, channel, prompt=req.single_prompt())
        return await _respond(request, engine, job, channel, Reply(False, model_id), req)

    def _job(req, channel: Channel, **prompt) -> Job:
        return Job(
            send=channel.send, max_tokens=req.limit(), sampling=req.sampling(defaults()), stop=req.stops(),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=req.bias(), **prompt,
        )

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [_model_card(model_id, created)]})

    async def model(request: Request):
        check_model(request.path_params["name"])
        return JSONResponse(_model_card(model_id, created))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, **engine.stats()})

    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(request: Request, e: HTTPException):
        message = {404: f"Unknown path {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(ApiError(e.status_code, message.get(e.status_code, str(e.detail))).body(), status_code=e.status_code)

    async def server_error(request: Request, e: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {ApiError: api_error, HTTPException: http_error, Exception: server_error}
    return Starlette(routes=routes, exception_handlers=handlers)


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-hybrid"}


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e})", None, "invalid_json") from None


async def _watch(request: Request, job: Job, channel: Channel):
    """Cancel job when the client disconnects (and wake whoever waits on its events)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
    channel.queue.put_nowait(Gone())


async def _next(channel: Channel):
    event = await channel.queue.get()
    if isinstance(event, Gone):
        raise event
    return event


async def _respond(request: Request, engine: Engine, job: Job, channel: Channel, reply: Reply, req):
    engine.submit(job)
    watcher = asyncio.create_task(_watch(request, job, channel))
    try:
        first = await _next(channel)
        if isinstance(first, Failed):
            raise ApiError(first.status, first.message, first.param, first.code)
        assert isinstance(first, Started)
        if req.stream:
            watcher.cancel()  # from here Starlette's stream watches the connection
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_stream(channel, job, reply, usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = []
        while not isinstance(event := await _next(channel), (Finished, Failed)):
            text.append(event)
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message, event.param, event.code)
        return JSONResponse(reply.whole("".join(text), event))
    except Gone:
        return JSONResponse(ApiError(499, "client closed the request").body(), status_code=499)
    finally:
        watcher.cancel()


async def _stream(channel: Channel, job: Job, reply: Reply, usage: bool):
    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    try:
        if reply.chat:
            yield event(reply.chunk(first=True, with_usage=usage))
        while True:
            ev = await channel.queue.get()
            if isinstance(ev, str):
                yield event(reply.chunk(ev, with_usage=usage))
            elif isinstance(ev, Finished):
                yield event(reply.chunk(None if reply.chat else "", ev.finish_reason, with_usage=usage))
                if usage:
                    yield event(reply.usage_chunk(ev))
                yield "data: [DONE]\n\n"
                return
            elif isinstance(ev, Failed):
                yield event(ApiError(ev.status, ev.message, ev.param, ev.code).body())
                return
    finally:  # finished, or cancelled by a disconnect: a running job stops at its next step
        job.cancelled.set()
