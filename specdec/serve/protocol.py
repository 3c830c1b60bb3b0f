"""The OpenAI request and response bodies the server speaks, as pydantic models with OpenAI's field names.

Requests are strict: a string where a number belongs, a bool for an integer, NaN or infinity, a negative
count or one above its maximum (`n` <= MAX_N, top log-probabilities <= MAX_LOGPROBS), an unknown field, or a
supported-by-OpenAI feature this server does not implement (echo, penalties, tools...) is refused (400,
docs/serve.md) rather than ignored. Extra fields beyond OpenAI's, as vLLM takes them: `top_k`,
`ignore_eos`, `return_token_ids`."""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from specdec.sampling import MAX_LOGPROBS, MAX_N

Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]
Count = Annotated[int, Strict(), Field(ge=1)]
Temperature = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)]
Stop = Union[Str, Annotated[list[Str], Field(max_length=4)]]
Choices = Annotated[int, Strict(), Field(ge=1, le=MAX_N)]  # n, best_of
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)]

# Fields OpenAI defines that this server does not implement, with the values that mean "not used"; any other
# value is refused naming the field, so that a client never silently gets less than it asked for.
UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "best_of": (None, 1),
}


class ApiError(Exception):
    """A request the server answers with an OpenAI-shaped error body and this HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 500: "internal_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def parse_request(model: type[BaseModel], raw: bytes):
    """The request body `raw` as `model`, or ApiError(400) naming the field that is wrong and why."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = str(err["loc"][0]) if err["loc"] else None
        if field in UNION_RULES:  # one error per alternative of the union would only confuse
            raise ApiError(400, f"{field} must be {UNION_RULES[field]}", param=field) from None
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"][1:]
                        if isinstance(p, int) or p.isidentifier() and p.islower() and p not in _TYPE_TAGS)
        raise ApiError(400, f"{field}{where}: {err['msg']}" if field else err["msg"], param=field) from None


UNION_RULES = {"prompt": "a string or a list of token ids (integers), or a one-element list of either",
               "stop": "a string or a list of at most 4 strings"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's steps into union alternatives


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[Bool] = None


class _GenerationRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")
    SUPPORTED: ClassVar[frozenset] = frozenset()  # names of UNSUPPORTED that this endpoint does implement
    model: Str
    max_tokens: Optional[Count] = None
    temperature: Optional[Temperature] = None  # OpenAI's default: 1
    top_p: Optional[TopP] = None
    top_k: Optional[Annotated[int, Strict(), Field(ge=0)]] = None  # extra field (0 = off), as vLLM takes it
    seed: Optional[Annotated[int, Strict(), Field(ge=-(1 << 63), lt=1 << 64)]] = None
    stop: Optional[Stop] = None
    stream: Optional[Bool] = None
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[Bool] = None  # extra field: generate through EOS up to max_tokens
    return_token_ids: Optional[Bool] = None  # extra field: the choice carries prompt_token_ids and token_ids
    user: Optional[Str] = None  # accepted and ignored, as OpenAI's own abuse-monitoring tag
    metadata: Optional[dict[str, Any]] = None
    store: Optional[Bool] = None
    service_tier: Optional[Str] = None
    n: Optional[Choices] = None  # completions of the prompt: choices 0..n-1 (n requests of it in the engine)
    # the unsupported ones: typed loosely here, refused by value below
    echo: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if name not in self.SUPPORTED and not any(value == v and type(value) is type(v) for v in neutral):
                # not a ValueError: pydantic lets it through as it is, so the error names the field
                raise ApiError(400, f"{name}={value!r} is not supported by this server", param=name,
                               code="unsupported")
        return self

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1


class CompletionRequest(_GenerationRequest):
    # one prompt: text, or token ids; a list holding exactly one of these is taken too
    prompt: Union[Str, Annotated[list[Int], Field(min_length=1)], Annotated[list[Str], Field(min_length=1)],
                  Annotated[list[Annotated[list[Int], Field(min_length=1)]], Field(min_length=1)]]
    SUPPORTED: ClassVar[frozenset] = frozenset({"best_of"})
    logprobs: Optional[TopLogprobs] = None  # each token's logprob and this many top ones (OpenAI's own cap: 5)
    best_of: Optional[Choices] = None  # generate best_of, return the n with the highest cumulative logprob

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < self.choices:
            raise ApiError(400, f"best_of ({self.best_of}) must be >= n ({self.choices})", param="best_of")
        if self.best_of is not None and self.best_of > self.choices and self.stream:
            raise ApiError(400, "best_of > n cannot be streamed (the best are known only at the end)",
                           param="best_of", code="unsupported")
        return self

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise ApiError(400, f"a list of {len(self.prompt)} prompts is not supported: send one prompt "
                                    f"per request", param="prompt", code="unsupported")
            self.prompt = self.prompt[0]
        if self.prompt == "":  # token ids are refused empty by the type; text only here (BOS alone is no prompt)
            raise ApiError(400, "prompt must not be empty: send at least one character or token id", param="prompt")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Str, list[TextPart]]
    name: Optional[Str] = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Count] = None  # wins over the older max_tokens
    logprobs: Optional[Bool] = None  # each token's logprob
    top_logprobs: Optional[TopLogprobs] = None  # and this many top ones at its position (needs logprobs: true)
    best_of: Any = None  # not an OpenAI chat field: refused unless 1
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _some_text(self):
        if not any(m.as_template_message()["content"] for m in self.messages):  # as an empty completions prompt
            raise ApiError(400, "messages must not be empty: every message's content is empty; send some text",
                           param="messages")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------------------------- responses


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # token ids (return_token_ids) ride as extra fields


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(_Body):
    """OpenAI's (legacy) completions logprobs: per token its text, logprob, the top ones by text (and the
    token itself), and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: Optional[list[ChatTokenLogprob]] = None


class CompletionChoice(_Body):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatDelta(_Body):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChoice(_Body):
    index: int = 0
    message: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatChunkChoice(_Body):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
