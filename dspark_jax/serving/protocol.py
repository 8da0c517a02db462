"""Request and response schemas of the OpenAI API subset the server speaks (pydantic v2).

Requests are validated strictly: unknown fields, wrong JSON types (a string where a number
belongs, 1 for true), non-finite numbers (`1e400` parses as infinity) and out-of-range values
are refused with a 400 naming the field, instead of being coerced or failing deep inside the
engine. Fields of the OpenAI API that this server does not implement are accepted only at their
neutral value (`best_of: 1`, `store: false`, `suffix: ""`, ...), so a client never
silently gets something other than what it asked for; fields with no effect on
the answer (`user`, `safety_identifier`, `prompt_cache_key`, `metadata`) are accepted and
ignored. Chat `tools` with `tool_choice` "auto" or "none" are taken (the server needs a tool-call
parser for "auto"); "required" and a named function are refused.
Where the OpenAI API lets a field be null, null means its default. Fields that take one of
several JSON types (`prompt`, `stop`, message `content`) pick the schema by the JSON type sent,
so an error names one place and says one thing.

Extensions shared with vLLM: `top_k`, `min_p`, `stop_token_ids`, `ignore_eos`, `min_tokens`,
`return_token_ids` (the generated token ids beside the text),
`stream_options.continuous_usage_stats` and, for chat, `chat_template_kwargs`
(`enable_thinking`); and vLLM's /tokenize and /detokenize bodies.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
)

# Engine arrays are int32; seeds are uint32 PRNG seeds.
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# The most choices one request may ask for (OpenAI's bound on `n`).
MAX_N = 128

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# Any 64-bit integer, as OpenAI and vLLM take it, folded onto the engine's uint32 seeds (-1 is
# 4294967295; seeds 2**32 apart draw alike).
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), AfterValidator(lambda seed: seed % 2**32)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# logit_bias: token ids as JSON object keys (no leading zeros, so no two keys name one token)
# to biases in OpenAI's range. The engine's --max-logit-bias bounds the entries a request may
# use; this bounds what a body may carry at all.
MAX_LOGIT_BIAS = 1024
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
        Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)],
    ],
    Field(max_length=MAX_LOGIT_BIAS),
]


def _json(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _only(*allowed: Any) -> AfterValidator:
    """Accepts a field this server does not implement at its neutral values only."""
    shown = " or ".join(_json(a) for a in allowed)

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"{_json(value)} is not supported by this server (use {shown})")
        return value

    return AfterValidator(check)


def _null_means(default: Any) -> BeforeValidator:
    """For fields the OpenAI API lets a client send as null: null is the default."""
    return BeforeValidator(lambda value: default if value is None else value)


def _by_json_type(kinds: dict[type, str], expected: str, items: dict[type, str] | None = None):
    """A union member chosen by the JSON type of the value (and of a list's first item, where
    `items` says so), so only that member's errors are reported; a value of no listed type is
    one error saying what was `expected`."""

    def pick(value: Any) -> str | None:
        if items is not None and isinstance(value, list) and value:
            return items.get(type(value[0]))
        return kinds.get(type(value))

    return Discriminator(
        pick, custom_error_type="invalid_type", custom_error_message=f"expected {expected}"
    )


Flag = Annotated[bool, _null_means(False)]
Stop = Annotated[
    Annotated[StopString, Tag("string")]
    | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), Tag("array")],
    _by_json_type({str: "string", list: "array"}, "a string or an array of strings"),
]
Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[TokenIds], Tag("id lists")],
    _by_json_type(
        {str: "text", list: "ids"},
        "a string, an array of token ids, or an array of one of either",
        items={int: "ids", str: "texts", list: "id lists"},
    ),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Flag = False
    # vLLM's: every chunk also carries the usage so far (with include_usage, as there).
    continuous_usage_stats: Flag = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _with_usage(cls, value: bool, info: ValidationInfo):
        if value and not info.data.get("include_usage"):
            raise ValueError("needs include_usage: true")
        return value


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    # vLLM's: the stop string (or stop token's text) that ended a choice ends its text too.
    include_stop_str_in_output: Flag = False
    # vLLM's: special tokens (those a tokenizer marks special) are left out of the text; false
    # writes them out. Stop tokens stay out either way, unless include_stop_str_in_output.
    skip_special_tokens: Annotated[bool, _null_means(True)] = True
    # vLLM's, for slow tokenizers only (Hugging Face's fast ones, this server's, have no such
    # choice): its neutral value.
    spaces_between_special_tokens: Annotated[bool | None, _only(None, True)] = None
    # vLLM's: the request's id (as the X-Request-Id header gives it, which it overrides).
    request_id: Annotated[str, Field(pattern=r"^[!-~]{1,256}$")] | None = None
    ignore_eos: Flag = False
    # No stop (token or string) ends a choice before this many tokens (vLLM's); at most the
    # request's token limit.
    min_tokens: Annotated[int, _null_means(0), Field(ge=0)] = 0
    n: Annotated[int, _null_means(1), Field(ge=1, le=MAX_N)] = 1
    stream: Flag = False
    stream_options: StreamOptions | None = None
    return_token_ids: Flag = False
    # vLLM's: log-probabilities name each token "token_id:<id>" rather than by its text.
    return_tokens_as_token_ids: Flag = False
    # vLLM's: only the prompt's last this many tokens are kept (-1: max_model_len of them).
    truncate_prompt_tokens: int | None = None
    # vLLM's: the queue's order under --scheduling-policy priority (lower first); else only 0.
    priority: Annotated[int, _null_means(0), Field(ge=-(2**63), lt=2**63)] = 0
    # vLLM's: requests share prefix-cache pages only with requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # No effect on the answer: OpenAI's end-user id (`safety_identifier` is its successor) and
    # its prompt-caching hint.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Applied where the server runs with --penalties; without it, only 0 (or null) is taken.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM's extension (Hugging Face's formula): > 0, 1 = off; None: the model's default.
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    # Applied where the server runs with --max-logit-bias; without it, only {} (or null).
    logit_bias: LogitBias | None = None
    # vLLM's: only these tokens may be drawn (at most --max-logit-bias of them).
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    store: Annotated[bool | None, _only(None, False)] = None
    metadata: dict[str, str] | None = None
    service_tier: Annotated[str | None, _only(None, "auto", "default")] = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _positive_or_all(cls, value: int | None):
        if value is not None and value < 1 and value != -1:
            raise ValueError("must be an integer >= 1, or -1 (as many as max_model_len)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def token_limit_param(self) -> str:
        """The field `token_limit` came from."""
        return "max_tokens"

    @property
    def default_token_limit(self) -> int | None:
        """New tokens when the request names no limit; None: what the context leaves."""
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def wants_logprobs(self) -> bool:
        """Whether each choice carries its tokens' log-probabilities."""
        return False

    @property
    def alternatives(self) -> int:
        """How many likeliest tokens each token's log-probabilities come with."""
        return 0

    @property
    def prompt_logprobs(self) -> int | None:
        """The alternatives of the prompt tokens' log-probabilities, when they are returned
        (completions' echo with logprobs); None: they are not."""
        return None

    @property
    def echoes(self) -> bool:
        """Whether each choice's text begins with its prompt (completions' echo)."""
        return False


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt` is text or token ids, or a list of either: a list of one
    is that prompt, a list of several asks for `n` choices of each (`prompts`)."""

    prompt: Prompt
    # vLLM's: what the tokenizer puts around a text prompt (a BOS, where it has one; Qwen3's
    # has none); false encodes the text alone. Token-id prompts are taken as they are.
    add_special_tokens: Annotated[bool, _null_means(True)] = True
    # The prompt before the answer (and, with logprobs, its tokens' log-probabilities).
    echo: Flag = False
    suffix: Annotated[str | None, _only(None, "")] = None
    best_of: Annotated[int | None, _only(None, 1)] = None
    # Each token's log-probability and that many alternatives' (OpenAI's bound, 5).
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt):
        if _several(prompt):
            if len(prompt) > 1:
                empty = [i for i, p in enumerate(prompt) if not p]
                if empty:
                    raise ValueError(f"prompt {empty[0]} of the {len(prompt)} is empty")
                return prompt
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, in order: one, or those of a list of several."""
        return list(self.prompt) if _several(self.prompt) else [self.prompt]

    @property
    def default_token_limit(self) -> int | None:
        """The Completions API's documented default (and vLLM's): 16 new tokens. Chat
        completions have none, and run to what the context leaves."""
        return 16

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def alternatives(self) -> int:
        return self.logprobs or 0

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def echoes(self) -> bool:
        return self.echo


def _several(prompt: Any) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextPart], Tag("parts")],
    _by_json_type({str: "string", list: "parts"}, "a string or an array of text parts"),
]


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments
    strict: bool | None = None  # accepted; the arguments are not constrained to the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the API returns it


class MessageToolCall(_Strict):
    """A call an assistant message made, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Only an assistant message may leave its content out (OpenAI: one that calls tools).
    content: Annotated[Content | None, Field(validate_default=True)] = None
    name: str | None = None  # accepted; the chat template sees role and content only
    tool_call_id: str | None = None  # which call a tool message answers
    # Fields the API returns on an assistant message, so a client can send a reply back as it
    # got it (`messages.append(reply.choices[0].message.model_dump())`): neutral values only.
    refusal: Annotated[str | None, _only(None)] = None
    tool_calls: list[MessageToolCall] | None = None
    # An earlier answer's reasoning, under vLLM's current name or DeepSeek's older one; the
    # template sees it as `reasoning_content` (Qwen3's templates read that name).
    reasoning: str | None = None
    reasoning_content: str | None = None
    function_call: Annotated[dict[str, Any] | None, _only(None)] = None
    audio: Annotated[dict[str, Any] | None, _only(None)] = None
    annotations: Annotated[list[Any] | None, _only(None, [])] = None

    @field_validator("content")
    @classmethod
    def _required(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _tool_only(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only a tool message answers a tool call")
        return value

    @field_validator("tool_calls", "reasoning", "reasoning_content")
    @classmethod
    def _assistant_only(cls, value, info: ValidationInfo):
        if value and info.data.get("role") != "assistant":
            raise ValueError(f"only an assistant message carries {info.field_name}")
        return value

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, content and, on an assistant turn,
        the calls it made and its reasoning."""
        message: dict[str, Any] = {"role": self.template_role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    @property
    def template_role(self) -> str:
        """The role the chat template sees: OpenAI's developer messages are system messages
        of the newer models, and templates know only the older name."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool = False


class _ChatRendering(_Strict):
    """How the chat template renders the end of the conversation (vLLM's fields)."""

    # False leaves out the assistant header that opens the answer; None: true, unless the final
    # message is continued.
    add_generation_prompt: bool | None = None
    # The final message is rendered open (without its end-of-turn), and the answer continues
    # it: a reply prefilled with its first words.
    continue_final_message: Flag = False

    @field_validator("continue_final_message")
    @classmethod
    def _open_end(cls, value: bool, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt"):
            raise ValueError(
                "needs add_generation_prompt: false (the answer continues the final message "
                "instead of opening a new one)"
            )
        return value

    @property
    def generation_prompt(self) -> bool:
        """Whether the rendered prompt ends with the header of a new assistant message."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


# What a chat template renders, as chat completions and /tokenize take it alike.
Messages = Annotated[list[ChatMessage], Field(min_length=1)]
Tools = Annotated[list[Tool], Field(max_length=128)]


class ChatCompletionRequest(GenerationRequest, _ChatRendering):
    """POST /v1/chat/completions, rendered with the target's chat template."""

    messages: Messages
    # vLLM's: the chat template writes the special tokens itself (true would add a BOS twice
    # where a tokenizer has one).
    add_special_tokens: Annotated[bool | None, _only(None, False)] = None
    max_completion_tokens: TokenCount | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    logprobs: bool | None = None  # each token's log-probability
    # ... and that many alternatives' (OpenAI's bound, 20; needs logprobs).
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Tools | None = None
    # "required" and a named function would need decoding constrained to the tools' schemas.
    tool_choice: (
        Annotated[
            Annotated[Literal["none", "auto", "required"], Tag("string")]
            | Annotated[NamedToolChoice, Tag("object")],
            _by_json_type({str: "string", dict: "object"}, "a string or an object"),
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    response_format: Annotated[dict[str, Any] | None, _only(None, {"type": "text"})] = None
    # Thinking is chat_template_kwargs.enable_thinking here; an effort cannot be honoured.
    reasoning_effort: Annotated[Any, _only(None)] = None

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

    @field_validator("tool_choice")
    @classmethod
    def _choosable(cls, value, info: ValidationInfo):
        tools = info.data.get("tools")
        if value in ("auto", "required") and not tools:
            raise ValueError(f'"{value}" needs tools')
        if isinstance(value, NamedToolChoice):
            names = [tool.function.name for tool in tools or ()]
            if value.function.name not in names:
                raise ValueError(
                    f"names {value.function.name!r}, which is not among the tools "
                    f"({', '.join(names) or 'none given'})"
                )
        if value not in (None, "auto", "none") and info.data.get("continue_final_message"):
            raise ValueError("a forced call cannot continue the final message")
        return value

    @property
    def forced_call(self) -> str | None:
        """The call a tool_choice forces: a function's name, "" for "required" (any of the
        tools), None where the model is free to call none."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def alternatives(self) -> int:
        return self.top_logprobs or 0

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def calls_tools(self) -> bool:
        """Tools offered and the model left free to call them (OpenAI's default with tools)."""
        return bool(self.tools) and self.tool_choice != "none"


# -- token counting (vLLM's /tokenize and /detokenize) -------------------------------------------
class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a `prompt`: its token ids as /v1/completions reads the same text."""

    model: str | None = None
    prompt: str
    # What /v1/completions does (a Hugging Face tokenizer's BOS, where it has one; Qwen3's has
    # none); false counts the text alone.
    add_special_tokens: Annotated[bool, _null_means(True)] = True
    return_token_strs: Flag = False


class TokenizeChatRequest(_ChatRendering):
    """POST /tokenize with `messages`: the prompt /v1/chat/completions would give the model."""

    model: str | None = None
    messages: Messages
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Tools | None = None
    return_token_strs: Flag = False
    # The template writes the special tokens itself; vLLM's neutral values of its other fields.
    add_special_tokens: Annotated[bool | None, _only(None, False)] = None

    @property
    def enable_thinking(self) -> bool:
        return self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking


class DetokenizeRequest(_Strict):
    """POST /detokenize: the text of token ids, special tokens written out."""

    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# -- responses -----------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The Completions API's (legacy) log-probabilities: one entry per token in each list;
    `top_logprobs` holds the likeliest tokens asked for and the token itself."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the likeliest tokens at its place, as many as asked


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallOut):
    """A streamed call: whole in one delta, `index` counting the choice's calls."""

    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null: an answer that is all reasoning, or only calls
    reasoning: str | None = None  # --reasoning-parser
    tool_calls: list[ToolCallOut] | None = None  # --tool-call-parser

    @model_serializer(mode="wrap")
    def _parts_when_parsed(self, handler) -> dict[str, Any]:
        """Leaves the parsers' parts out when null (absent where the server runs no parser);
        content stays, null or not."""
        parsed = ("reasoning", "tool_calls")
        return {k: v for k, v in handler(self).items() if v is not None or k not in parsed}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    """A streamed message delta: its fields are left out, not null, when it has none (the last
    chunk's delta is {})."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
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
    # vLLM's: the model the id serves (a folder or hub id), and the model it was adapted from
    # (none here: no adapters).
    root: str
    parent: str | None = None
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
