"""Request and response schemas of the OpenAI API subset the server speaks (pydantic v2).

Requests are validated strictly: unknown fields, wrong JSON types (a string where a number
belongs, 1 for true), non-finite numbers (`1e400` parses as infinity) and out-of-range values
are refused with a 400 naming the field, instead of being coerced or failing deep inside the
engine. Fields of the OpenAI API that this server does not implement are accepted only at their
neutral value (`n: 1`, `presence_penalty: 0`, `logprobs: null`, ...), so a client never
silently gets something other than what it asked for.

Extensions shared with vLLM: `top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`
(the generated token ids beside the text) and, for chat, `chat_template_kwargs`
(`enable_thinking`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Engine arrays are int32; seeds are uint32 PRNG seeds.
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=0, lt=2**32)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _require_neutral(model: BaseModel, neutral: dict[str, tuple[Any, ...]]) -> None:
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value not in allowed:
            shown = " or ".join("null" if a is None else repr(a) for a in allowed)
            raise ValueError(f"{name}={value!r} is not supported by this server (use {shown})")


_NEUTRAL_SAMPLING = {
    "n": (1,),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "logit_bias": (None, {}),
}


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self):
        _require_neutral(self, _NEUTRAL_SAMPLING)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def token_limit_param(self) -> str:
        """The field `token_limit` came from."""
        return "max_tokens"

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt` is text or token ids; a list of one of either is accepted
    as the same single prompt (the forms the OpenAI API allows), more than one is refused."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @model_validator(mode="after")
    def _single_prompt(self):
        _require_neutral(
            self,
            {"echo": (False,), "suffix": (None,), "best_of": (None, 1), "logprobs": (None,)},
        )
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(
                    f"prompt holds {len(prompt)} prompts; this server takes one per request"
                )
            self.prompt = prompt[0]
        if not self.prompt:
            raise ValueError("prompt is empty")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool = False


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions, rendered with the target's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        _require_neutral(
            self,
            {
                "logprobs": (None, False),
                "top_logprobs": (None,),
                "tools": (None, []),
                "tool_choice": (None, "none"),
            },
        )
        return self

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens (the current name) wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def enable_thinking(self) -> bool:
        return self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking


# -- responses -----------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark-jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
