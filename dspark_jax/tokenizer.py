"""Tokenizer glue: the byte tokenizer of the tiny test models, Hugging Face loading, chat encoding,
and the tokenizer bundle (the files a model folder carries next to its weights).

Two kinds of tokenizer are supported, both through the same functions:

- `ByteTokenizer` for our tiny byte-level models (ids 0-255 are UTF-8 bytes, 256 EOS, 257 mask).
  These models know no chat format, so a conversation is the plain concatenation of the message
  contents; a conversation that ends with an assistant message is closed by EOS, the only stop
  token the byte models produce.
- Any Hugging Face tokenizer with a chat template (Qwen3 and friends), loaded from local files.

`encode_conversation` derives the assistant loss mask of a Hugging Face chat template by rendering
growing prefixes of the conversation and diffing the token ids. That assumes the template is
prefix-stable: rendering messages[:i] (with the generation prompt when message i is the
assistant's) yields a token prefix of rendering messages[:i + 1]. Templates that rewrite earlier
turns depending on what follows (the real Qwen3 template drops the empty think block of assistant
turns that precede a later user message) break that assumption for multi-turn conversations, and
`ChatTemplateError` is raised rather than a silently wrong mask.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_jax.config import read_config_json
from dspark_jax.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]


class _NoTorchAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


def _drop_torch_advice() -> None:
    """Without PyTorch (it is not a dependency: we use transformers for tokenizers only),
    importing transformers logs that its models are unavailable, a line before every command's
    output; this drops that one record and nothing else."""
    log = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in log.filters):
        log.addFilter(_NoTorchAdvice())

_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


# The tokenizer bundle: files a serving program needs next to the target weights (tokenizer,
# chat template, stop tokens), whichever of them a model folder has.
TOKENIZER_BUNDLE = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
)


class TokenizerNotFoundError(UserError):
    """A model folder holds neither tokenizer files nor a byte-model config."""


class ChatTemplateError(UserError):
    """A conversation cannot be rendered, or the chat template is not prefix-stable."""


class ByteTokenizer:
    """Tokenizer of the tiny byte-level test models.

    Ids 0-255 are raw UTF-8 bytes, 256 is EOS, 257 is the drafter's mask token; the vocabulary is
    padded to 288 (258-287 unused).
    """

    vocab_size = 288
    eos_token_id = 256
    mask_token_id = 257
    pad_token_id = None

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids; special ids (>= 256) are skipped, invalid UTF-8 is replaced."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"negative token id in {ids}")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_string(self, token: int) -> str:
        """A token's own name: a printable ASCII byte as itself, any other byte as <0xNN> (the
        byte-fallback notation of SentencePiece vocabularies), the special ids by role."""
        if 32 <= token < 127:
            return chr(token)
        if 0 <= token < 256:
            return f"<0x{token:02X}>"
        return {256: "<eos>", 257: "<mask>"}.get(token, f"<unused{token}>")

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The plain concatenation of the message contents (the byte models know no chat format)."""
        return "".join(_content(m, i) for i, m in enumerate(messages))

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=288, eos=256, mask=257)"


if TYPE_CHECKING:
    Tokenizer = ByteTokenizer | PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a model folder.

    A Hugging Face tokenizer (local files only) when the folder has tokenizer files; else
    `ByteTokenizer` when its config.json describes one of our byte models (vocab_size 288, eos 256).
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise TokenizerNotFoundError(f"model folder {model_dir!r} does not exist")
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in _HF_TOKENIZER_FILES):
        _drop_torch_advice()
        from transformers import AutoTokenizer

        return without_length_limit(
            AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        )
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        config = read_config_json(model_dir)
        eos = config.get("eos_token_id")
        if config.get("vocab_size") == ByteTokenizer.vocab_size and eos in (256, [256]):
            return ByteTokenizer()
    raise TokenizerNotFoundError(
        f"no tokenizer in {model_dir!r}: expected one of {', '.join(_HF_TOKENIZER_FILES)}, or a "
        "config.json of a byte model (vocab_size 288, eos_token_id 256)"
    )


_NO_LIMIT = int(1e30)  # transformers' own "no maximum" (VERY_LARGE_INTEGER)


def without_length_limit(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with its `model_max_length` lifted (in place): every command measures a
    prompt against the engine's context and refuses one that cannot fit in one line; a Hugging
    Face tokenizer's own limit would only log "Token indices sequence length is longer than the
    specified maximum ... will result in indexing errors" ahead of that line, which misleads."""
    if getattr(tokenizer, "model_max_length", None) is not None:
        tokenizer.model_max_length = _NO_LIMIT
    return tokenizer


def copy_tokenizer_bundle(src: Path, dst: Path) -> list[str]:
    """Copies the tokenizer bundle (`TOKENIZER_BUNDLE`) of model folder `src` into `dst`; returns
    the names of the files copied."""
    copied = []
    for item in sorted(src.iterdir()):
        if item.is_file() and any(fnmatch.fnmatch(item.name, p) for p in TOKENIZER_BUNDLE):
            shutil.copy2(item, dst / item.name)
            copied.append(item.name)
    return copied


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of a prompt conversation, ready for generation; `tools` (OpenAI's function
    definitions) are rendered by the template, which must know them (`renders_tools`).
    `continue_final_message` renders the last message open, without what ends its turn, so that
    generation continues it (not with `add_generation_prompt`)."""
    _check_messages(messages)
    if tools and not renders_tools(tokenizer):
        raise ChatTemplateError("the model's chat template does not render tools")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message needs add_generation_prompt=False")
    if isinstance(tokenizer, ByteTokenizer):  # contents alone: the last one is open already
        return tokenizer.encode(tokenizer.render_chat(messages))
    return _render_ids(
        tokenizer, messages, add_generation_prompt, enable_thinking, tools, continue_final_message
    )


def renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable (Qwen's templates do; a template that
    does not would drop the tools without a word)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: transformers picks "tool_use" for tools
        return any("tools" in str(t) for t in template.values())
    return template is not None and "tools" in template


def encode_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    enable_thinking: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a loss mask, 1 exactly on assistant-produced tokens.

    Assistant-produced means the assistant content and its end-of-turn token (the tokenizer's EOS,
    `<|im_end|>` for Qwen3); role headers, generation-prompt tokens (such as Qwen3's empty think
    block in non-thinking mode), and whatever the template writes after the end-of-turn token are 0.
    """
    _check_messages(messages)
    if isinstance(tokenizer, ByteTokenizer):
        return _encode_conversation_bytes(tokenizer, messages)
    return _encode_conversation_hf(tokenizer, messages, enable_thinking)


def decode_text(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    stop_tokens: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> str:
    """Text of generated ids, without `stop_tokens` and, unless `skip_special_tokens` is false,
    without special tokens (EOS included). The byte tokenizer's special ids have no text."""
    stops = set(stop_tokens)
    ids = [i for i in ids if i not in stops]
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a completion prompt; `add_special_tokens` adds what a Hugging Face tokenizer
    puts around a text (its BOS, where it has one), as `tokenizer.encode` does by default. The
    byte tokenizer adds nothing."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def token_strings(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id's token as the vocabulary names it (a byte-level BPE token reads "Ġdef"), not
    its decoded text."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.token_string(int(i)) for i in ids]
    names = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    return ["" if name is None else str(name) for name in names]


def decode_all(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of any ids with the special tokens written out (a rendered chat prompt decodes to
    the template's text): the inverse of `encode_text` and `encode_chat`. The byte tokenizer's
    special ids have no text and are skipped."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def stop_token_ids(
    model_dir: str | os.PathLike, eos_token_ids: Sequence[int], tokenizer: Tokenizer
) -> tuple[int, ...]:
    """The ids that end generation, in order and without repeats: the config's EOS ids, those
    of the folder's generation_config.json, then the tokenizer's EOS.

    Qwen3's config.json names only <|im_end|>; generation_config.json adds <|endoftext|>.
    """
    ids = list(eos_token_ids)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        gen_eos = read_config_json(gen_path).get("eos_token_id")
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _content(message: Message, index: int) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        raise ChatTemplateError(f"message {index} has no string 'content': {message!r}")
    return content


def _check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ChatTemplateError("empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} is not a {{'role', 'content'}} mapping: {m!r}")
        _content(m, i)


def _encode_conversation_bytes(
    tokenizer: ByteTokenizer, messages: Sequence[Message]
) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        piece = tokenizer.encode(_content(m, i))
        ids += piece
        mask += [int(m["role"] == "assistant")] * len(piece)
    if messages[-1]["role"] == "assistant":
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return ids, mask


def _render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    enable_thinking: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    if tokenizer.chat_template is None:
        raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat_template")
    from jinja2 import TemplateError

    # enable_thinking travels as a template variable: templates that ignore it still render.
    try:
        ids = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            enable_thinking=enable_thinking,
            **({"tools": list(tools)} if tools else {}),
            **({"continue_final_message": True} if continue_final_message else {}),
        )
    except TemplateError as e:
        # raise_exception(...) in a template: roles it does not accept, turns that must alternate
        raise ChatTemplateError(f"the chat template refuses the conversation: {e}") from None
    except ValueError as e:
        if not continue_final_message:
            raise
        # transformers finds the final message's text in the rendering to cut what follows it;
        # a template that rewrites or drops that text leaves nothing to continue.
        raise ChatTemplateError(f"the final message cannot be continued: {e}") from None
    return [int(i) for i in ids]


def _encode_conversation_hf(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], enable_thinking: bool
) -> tuple[list[int], list[int]]:
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        rendered = _render_ids(tokenizer, messages[: i + 1], False, enable_thinking)
        if m["role"] == "assistant":
            if i == 0:
                raise ChatTemplateError(
                    "a conversation cannot start with an assistant message: the assistant span is "
                    "found after the generation prompt of the preceding messages"
                )
            header = _render_ids(tokenizer, messages[:i], True, enable_thinking)
            _require_prefix(ids, header, i, "the generation prompt before it")
            _require_prefix(header, rendered, i, "its generation prompt")
            mask += [0] * (len(header) - len(ids))
            span = rendered[len(header) :]
            produced = span.index(eos_id) + 1 if eos_id in span else len(span)
            mask += [1] * produced + [0] * (len(span) - produced)
        else:
            _require_prefix(ids, rendered, i, "the conversation before it")
            mask += [0] * (len(rendered) - len(ids))
        ids = rendered
    return ids, mask


def _require_prefix(prefix: list[int], ids: list[int], index: int, what: str) -> None:
    if ids[: len(prefix)] != prefix:
        raise ChatTemplateError(
            f"chat template is not prefix-stable at message {index}: the tokens of {what} are not "
            "a prefix of the tokens rendered with message "
            f"{index} (the template rewrites earlier turns, or tokens merge across the boundary), "
            "so the assistant loss mask cannot be derived"
        )
