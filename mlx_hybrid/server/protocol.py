"""OpenAI's wire format: the request fields the server takes, checked strictly (an unknown field
or a wrong type is an error naming it, as OpenAI's API answers), and the bodies of responses,
stream chunks and errors.

Fields OpenAI defines that the server cannot honour (tools, logprobs, n > 1, ...) are accepted at
their neutral values only, so a client never gets silently less than it asked for. top_k, min_p
and repetition_penalty are accepted as extensions, as mlx-lm's server does.
"""

import time
import uuid
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlx_hybrid.sampling import SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = False  # padding against length side channels: meaningless on localhost


class ResponseFormat(Strict):
    type: Literal["text"]


class Common(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int = 1
    logprobs: bool | int | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """defaults (the server's, `app.create_app`) under the fields this request sets."""
        given = dict(temp=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     repetition_penalty=self.repetition_penalty, seed=self.seed)
        return replace(defaults, **{k: v for k, v in given.items() if v is not None})

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids", "logit_bias", "invalid_value") from None

    def check(self):
        """Fields whose non-neutral values the server cannot honour."""
        unsupported = [("n", self.n != 1), ("logprobs", bool(self.logprobs))]
        for name, used in unsupported:
            if used:
                raise ApiError(400, f"'{name}' is not supported by this server (only its default)", name, "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def check(self):
        super().check()
        if self.tools:
            raise ApiError(400, "'tools' is not supported by this server", "tools", "unsupported_parameter")
        if self.top_logprobs:
            raise ApiError(400, "'top_logprobs' is not supported by this server", "top_logprobs", "unsupported_parameter")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    def check(self):
        super().check()
        for name, used in (("echo", self.echo), ("best_of", self.best_of != 1), ("suffix", self.suffix)):
            if used:
                raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids, or a list holding exactly one of those."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt", "unsupported_parameter")
            return p[0]
        return p

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


FIELD_NAMES = {name for m in (ChatRequest, CompletionRequest, Message, TextPart, StreamOptions, ResponseFormat) for name in m.model_fields}


def parse(model: type[Strict], body) -> Strict:
    """The request, or an ApiError for its first problem, naming the field as OpenAI does."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_value")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _field_error(e.errors(include_url=False)) from None
    request.check()
    return request


def _field_error(errors: list[dict]) -> ApiError:
    # Of a union's alternatives, the error that got furthest into the value says most.
    err = max(errors, key=lambda e: len(e["loc"]))
    param, last = "", len(err["loc"]) - 1
    for i, part in enumerate(err["loc"]):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in FIELD_NAMES or (i == last and err["type"] == "extra_forbidden"):
            param += f".{part}" if param else part
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    if err["type"] == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
    return ApiError(400, f"Invalid value for '{param}': {err['msg']}", param, code)


class Reply:
    """The response bodies of one completion, chat or text: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _body(self, obj: str, choices: list, usage) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage}

    def whole(self, text: str, finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finished.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finished.finish_reason}
        return self._body(self.object, [choice], usage(finished))

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False, with_usage: bool = False) -> dict:
        """A stream chunk: the first carries the role (chat), the last the finish reason; usage is
        null in each when the client asked for a final usage chunk (OpenAI's convention)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = self._body(self.object + (".chunk" if self.chat else ""), [choice], None)
        if not with_usage:
            del body["usage"]
        return body

    def usage_chunk(self, finished) -> dict:
        return self._body(self.object + (".chunk" if self.chat else ""), [], usage(finished))


def usage(finished) -> dict:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }
