"""Tokenizer glue: byte tokenizer, loading, chat encoding and the assistant loss mask."""

import json
import os

import pytest
from _chat_tokenizer import QWEN3_HISTORY_TEMPLATE, build_chat_tokenizer

from dspark_jax.embedded import TINY_DIR
from dspark_jax.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    TokenizerNotFoundError,
    encode_chat,
    encode_conversation,
    load_tokenizer,
)

ASSETS = str(TINY_DIR)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ünï"},
    {"role": "assistant", "content": "Hello! ✓"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return build_chat_tokenizer()


def masked(ids, mask):
    return [i for i, m in zip(ids, mask, strict=True) if m]


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids == list("héllo ✓".encode())
    assert tok.decode(ids + [256, 257, 287]) == "héllo ✓"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"
    assert (tok.eos_token_id, tok.mask_token_id, tok.vocab_size) == (256, 257, 288)
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_byte_conversation_is_plain_concatenation_with_eos():
    tok = ByteTokenizer()
    ids, mask = encode_conversation(tok, CONVERSATION)
    text = "".join(m["content"] for m in CONVERSATION)
    assert ids == tok.encode(text) + [256]
    assert masked(ids, mask) == tok.encode("Hello! ✓") + tok.encode("4") + [256]
    prompt = encode_chat(tok, CONVERSATION[:2])
    assert prompt == tok.encode("Be brief.Hi ünï")
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])


def test_hf_mask_covers_exactly_assistant_content_and_end_of_turn(hf_tokenizer):
    tok = hf_tokenizer
    ids, mask = encode_conversation(tok, CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert ids == tok.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=False, enable_thinking=False
    )
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    want = tok.encode("Hello! ✓") + [im_end] + tok.encode("4") + [im_end]
    assert masked(ids, mask) == want
    # Each masked run starts right after the generation prompt (with its empty think block).
    think_end = tok.convert_tokens_to_ids("</think>")
    runs = [i for i in range(len(mask)) if mask[i] and not mask[i - 1]]
    assert len(runs) == 2
    for start in runs:
        assert ids[start - 3 : start] == [think_end] + tok.encode("\n\n")


def test_hf_thinking_mode_masks_model_written_think_block():
    tok = build_chat_tokenizer()
    ids, mask = encode_conversation(tok, CONVERSATION[:3], enable_thinking=True)
    assert tok.decode(masked(ids, mask)) == "Hello! ✓<|im_end|>"
    assert "<think>" not in tok.decode(ids)


def test_encode_chat_generation_prompt(hf_tokenizer):
    tok = hf_tokenizer
    ids = encode_chat(tok, CONVERSATION[:2])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = encode_chat(tok, CONVERSATION[:2], enable_thinking=True)
    assert tok.decode(thinking).endswith("<|im_start|>assistant\n")
    bare = encode_chat(tok, CONVERSATION[:2], add_generation_prompt=False)
    assert tok.decode(bare).endswith("Hi ünï<|im_end|>\n")


def test_encode_chat_continues_the_final_message(hf_tokenizer):
    tok = hf_tokenizer
    reply = CONVERSATION[:2] + [{"role": "assistant", "content": "Sure"}]
    ids = encode_chat(tok, reply, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(ids) == tok.decode(encode_chat(tok, CONVERSATION[:2])) + "Sure"
    with pytest.raises(ChatTemplateError, match="needs add_generation_prompt=False"):
        encode_chat(tok, reply, continue_final_message=True)
    # A template that rewrites the final message leaves no text of it to continue.
    shouting = build_chat_tokenizer(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | upper }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="final message cannot be continued"):
        encode_chat(shouting, reply, add_generation_prompt=False, continue_final_message=True)
    # The byte models' prompt is the contents alone: the final one is open already.
    assert encode_chat(ByteTokenizer(), reply, False, continue_final_message=True)[-4:] == list(
        b"Sure"
    )


def test_template_without_enable_thinking_still_works():
    tok = build_chat_tokenizer(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids, mask = encode_conversation(tok, CONVERSATION[1:3])
    assert tok.decode(masked(ids, mask)) == "Hello! ✓<|im_end|>"
    assert tok.decode(encode_chat(tok, CONVERSATION[1:2])).endswith("[assistant]")


def test_template_that_rewrites_history_is_rejected():
    tok = build_chat_tokenizer(QWEN3_HISTORY_TEMPLATE)
    ids, mask = encode_conversation(tok, CONVERSATION[:3])
    assert tok.decode(masked(ids, mask)) == "Hello! ✓<|im_end|>"
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 3"):
        encode_conversation(tok, CONVERSATION)


def test_bad_conversations_are_rejected(hf_tokenizer):
    for tok in (ByteTokenizer(), hf_tokenizer):
        with pytest.raises(ChatTemplateError, match="empty"):
            encode_conversation(tok, [])
        with pytest.raises(ChatTemplateError, match="content"):
            encode_conversation(tok, [{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError, match="start with an assistant"):
        encode_conversation(hf_tokenizer, [{"role": "assistant", "content": "x"}])
    bare = build_chat_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        encode_chat(bare, CONVERSATION[:2])


def test_load_tokenizer(tmp_path, hf_tokenizer):
    hf_dir = tmp_path / "hf"
    hf_tokenizer.save_pretrained(hf_dir)
    loaded = load_tokenizer(hf_dir)
    assert not isinstance(loaded, ByteTokenizer)
    assert encode_conversation(loaded, CONVERSATION) == encode_conversation(
        hf_tokenizer, CONVERSATION
    )
    assert isinstance(load_tokenizer(os.path.join(ASSETS, "target")), ByteTokenizer)
    assert isinstance(load_tokenizer(os.path.join(ASSETS, "draft")), ByteTokenizer)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 151936, "eos_token_id": 2}))
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer"):
        load_tokenizer(other)
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_no_pytorch_advice_before_a_commands_output():
    """PyTorch is not a dependency (transformers serves tokenizers only); without it,
    transformers' import logged "PyTorch was not found. Models won't be available ..." before
    every command's first line. Loading a tokenizer drops that record, and only that one."""
    import subprocess
    import sys

    probe = (
        "import logging, sys\n"
        "sys.modules['torch'] = None  # as on a machine without PyTorch\n"
        "from dspark_jax.embedded import EMBEDDED_TARGET\n"
        "from dspark_jax.tokenizer import load_tokenizer\n"
        "load_tokenizer(EMBEDDED_TARGET)\n"
        "logging.getLogger('transformers').warning('another warning stays')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr
    assert "another warning stays" in done.stderr


def test_a_prompt_longer_than_the_context_is_refused_in_one_line():
    """transformers' own limit (model_max_length 4096 in the embedded target's tokenizer) logged
    "Token indices sequence length is longer than the specified maximum ... will result in
    indexing errors" before the command's one-line refusal; every command measures prompts
    against the engine's context itself, so load_tokenizer lifts that limit."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "dspark_jax.cli", "generate", "--prompt", "word " * 6000]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "shorten the prompt" in lines[0], lines
