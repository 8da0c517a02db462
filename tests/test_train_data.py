"""The grain input pipeline on temporary JSONL files."""

import dataclasses
import json
import pickle
import time

import numpy as np
import pytest
from _chat_tokenizer import QWEN3_HISTORY_TEMPLATE, build_chat_tokenizer

from dspark_jax.tokenizer import ByteTokenizer, ChatTemplateError, encode_conversation
from dspark_jax.training.data import (
    BatchRows,
    DataConfig,
    DataError,
    JsonlConversationSource,
    bucket_of,
    conversation_kinds,
    make_iterator,
    pad_batch,
    resolve_pad_id,
    template_markers,
    tokenize_example,
)

BYTES = ByteTokenizer()
ASSISTANT_A = {"role": "assistant", "content": "a"}


def record(i: int) -> dict:
    """Conversation i, alternating the two role-explicit formats (odd: DeepSpec's multi-turn
    `conversations`); every assistant reply is unique."""
    if i % 2:
        texts = [f"question {i}", f"answer {i}.", f"more {i}", f"done {i}!"]
        return {
            "conversations": [
                {"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(texts)
            ]
        }
    return {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}."},
        ]
    }


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture
def dataset_path(tmp_path):
    return write_jsonl(tmp_path / "conv.jsonl", [json.dumps(record(i)) for i in range(12)])


def answers(ex_tokens, ex_mask, tokenizer=BYTES):
    """The decoded assistant tokens of one example (identifies the conversation)."""
    return tokenizer.decode(ex_tokens[ex_mask.astype(bool)].tolist())


def take(it, n):
    return [next(it) for _ in range(n)]


def examples(batches, tokenizer=BYTES):
    return [
        answers(t, m, tokenizer)
        for b in batches
        for t, m in zip(b["tokens"], b["loss_mask"], strict=True)
    ]


def test_tokenize_example_pads_truncates_and_masks():
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    ex = tokenize_example({"messages": messages}, BYTES, seq_lens=(8,), pad_id=256)
    np.testing.assert_array_equal(ex["tokens"], [97, 98, 99, 100, 256, 256, 256, 256])
    np.testing.assert_array_equal(ex["loss_mask"], [0, 0, 1, 1, 1, 0, 0, 0])
    assert ex["length"] == ex["num_tokens"] == 5
    assert ex["tokens"].dtype == np.int32 and ex["loss_mask"].dtype == bool
    short = tokenize_example({"messages": messages}, BYTES, seq_lens=(3,), pad_id=0)
    np.testing.assert_array_equal(short["tokens"], [97, 98, 99])
    np.testing.assert_array_equal(short["loss_mask"], [0, 0, 1])
    assert short["length"] == 3 and short["num_tokens"] == 5


def test_examples_go_to_the_smallest_bucket_that_holds_them():
    assert [bucket_of(n, (4, 8, 16)) for n in (1, 4, 5, 8, 9, 16, 17, 100)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        2,
        2,
    ]
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    for seq_lens, want in [((4, 5, 8), 5), ((4, 6), 6), ((2, 3), 3)]:
        ex = tokenize_example({"messages": messages}, BYTES, seq_lens=seq_lens, pad_id=0)
        assert ex["tokens"].shape == ex["loss_mask"].shape == (want,)
        assert ex["length"] == min(5, want) and ex["num_tokens"] == 5


@pytest.mark.parametrize("use_hf", [False, True])
def test_batches_mask_exactly_assistant_tokens(dataset_path, use_hf):
    tok = build_chat_tokenizer() if use_hf else BYTES
    config = DataConfig(paths=(dataset_path,), seq_len=160, batch_size=4, num_epochs=1)
    batches = list(make_iterator(config, tok))
    assert len(batches) == 3
    for b in batches:
        assert b["tokens"].shape == b["loss_mask"].shape == (4, 160)
        assert b["tokens"].dtype == np.int32 and b["length"].shape == (4,)
        for tokens, mask, length in zip(b["tokens"], b["loss_mask"], b["length"], strict=True):
            assert not mask[length:].any()
            assert (tokens[length:] == resolve_pad_id(tok, None)).all()
    by_text = {}
    for i in range(12):
        ids, mask = encode_conversation(tok, JsonlConversationSource([dataset_path])[i]["messages"])
        by_text[answers(np.array(ids), np.array(mask), tok)] = (ids, mask)
    end = "<|im_end|>" if use_hf else ""
    want = set()
    for i in range(12):
        want.add(f"answer {i}.{end}done {i}!{end}" if i % 2 else f"answer {i}.{end}")
    assert set(examples(batches, tok)) == set(by_text) == want
    for b in batches:
        for tokens, mask, length in zip(b["tokens"], b["loss_mask"], b["length"], strict=True):
            ids, m = by_text[answers(tokens, mask, tok)]
            assert tokens[:length].tolist() == ids and mask[:length].astype(int).tolist() == m


def test_deterministic_given_seed_and_reshuffled_each_epoch(dataset_path):
    config = DataConfig(paths=(dataset_path,), seq_len=64, batch_size=3, seed=5)
    first = examples(take(make_iterator(config, BYTES), 8))
    again = examples(take(make_iterator(config, BYTES), 8))
    assert first == again
    other = examples(take(make_iterator(DataConfig(**{**vars(config), "seed": 6}), BYTES), 8))
    assert other != first
    epochs = [first[:12], first[12:24]]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 12
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize("num_records", [12, 13])
def test_processes_read_their_rows_of_the_one_process_batches(tmp_path, num_records):
    path = write_jsonl(tmp_path / "c.jsonl", [json.dumps(record(i)) for i in range(num_records)])
    config = DataConfig(paths=(path,), seq_len=64, batch_size=2, num_epochs=1, seed=3)
    seen = [examples(make_iterator(config, BYTES, BatchRows.of_process(p, 2, 2))) for p in range(2)]
    assert len(seen[0]) == len(seen[1]) == 6
    assert not set(seen[0]) & set(seen[1])
    # With 13 records the last example of the shuffled epoch does not fill a global batch of 4.
    assert len(set(seen[0]) | set(seen[1])) == 12
    # Global batch k is rows 0-1 from process 0 and rows 2-3 from process 1: exactly the batches
    # one process reading the whole global batch sees.
    whole = examples(make_iterator(dataclasses.replace(config, batch_size=4), BYTES))
    assert whole == [e for k in range(3) for p in range(2) for e in seen[p][2 * k : 2 * k + 2]]
    # Rows need not be contiguous (a mesh may interleave the processes' devices).
    for rows in ((1, 3), (0, 2)):
        got = examples(make_iterator(config, BYTES, BatchRows(rows, 4)))
        assert got == [whole[4 * k + r] for k in range(3) for r in rows]


def test_batch_rows_are_checked():
    assert BatchRows.of_process(1, 3, 2) == BatchRows((2, 3), 6)
    for rows, size in [((), 4), ((1, 0), 4), ((1, 1), 4), ((-1, 2), 4), ((2, 4), 4)]:
        with pytest.raises(DataError, match="batch rows"):
            BatchRows(rows, size)
    with pytest.raises(DataError, match="process_index"):
        BatchRows.of_process(2, 2, 1)


def test_pad_batch_adds_positions_without_loss():
    batch = {
        "tokens": np.array([[5, 6], [7, 8]], np.int32),
        "loss_mask": np.array([[0, 1], [1, 1]], bool),
        "length": np.array([2, 2], np.int32),
        "num_tokens": np.array([2, 9], np.int32),
    }
    padded = pad_batch(batch, 4, pad_id=256)
    np.testing.assert_array_equal(padded["tokens"], [[5, 6, 256, 256], [7, 8, 256, 256]])
    np.testing.assert_array_equal(padded["loss_mask"], [[0, 1, 0, 0], [1, 1, 0, 0]])
    assert padded["tokens"].dtype == np.int32 and padded["loss_mask"].dtype == bool
    for key in ("length", "num_tokens"):
        np.testing.assert_array_equal(padded[key], batch[key])
    assert pad_batch(batch, 2, pad_id=0)["tokens"].shape == (2, 2)
    with pytest.raises(DataError, match="cannot pad"):
        pad_batch(batch, 1, pad_id=0)


def test_resume_from_iterator_state(dataset_path):
    config = DataConfig(paths=(dataset_path,), seq_len=64, batch_size=5, seed=11)
    it = make_iterator(config, BYTES)
    take(it, 5)
    state = it.get_state()
    want = take(it, 3)  # crosses the epoch boundary: 12 examples, batches of 5
    resumed = make_iterator(config, BYTES)
    resumed.set_state(json.loads(json.dumps(state)))
    got = take(resumed, 3)
    for a, b in zip(want, got, strict=True):
        for key in ("tokens", "loss_mask", "length"):
            np.testing.assert_array_equal(a[key], b[key])


def test_malformed_lines_name_file_and_line(tmp_path):
    good = json.dumps(record(0))
    no_assistant = "record has no assistant content"
    prompts = 'a \\{"turns": \\[...\\]\\} record is read as prompts'
    cases = {
        "{not json": "malformed JSON",
        json.dumps({"turns": ["only a question"]}): prompts,
        json.dumps({"messages": [{"role": "user", "content": "q"}]}): no_assistant,
        json.dumps({"turns": ["q", "a"]}): prompts,
        json.dumps({"messages": [{"role": "user"}]}): "messages\\[0\\]",
        json.dumps({"conversations": [{"role": "user", "content": "q"}, "x"]}): "conversations",
        json.dumps({"text": "hi"}): "record has none of 'messages', 'conversations', 'turns'",
        json.dumps([1, 2]): "record is a list, not an object",
    }
    for n, (bad, reason) in enumerate(cases.items()):
        path = write_jsonl(tmp_path / f"bad{n}.jsonl", [good, "", bad, good])
        with pytest.raises(DataError, match=f"bad{n}\\.jsonl:3: {reason}"):
            JsonlConversationSource([path])
    path = write_jsonl(tmp_path / "mixed.jsonl", [good, *cases, good])
    source = JsonlConversationSource([path], skip_bad_records=True)
    assert len(source) == 2 and source.num_skipped == len(cases)
    # said as generate and eval say it for a prompts file
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(f"{good}\n{good}\n".encode() + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:3: not UTF-8 text \(invalid"):
        JsonlConversationSource([str(latin1)])
    assert source[1]["where"].endswith("mixed.jsonl:10")
    config = DataConfig(paths=(path,), seq_len=32, batch_size=2, skip_bad_records=True)
    assert next(make_iterator(config, BYTES))["tokens"].shape == (2, 32)


def test_lone_surrogates_are_refused_up_front_by_file_and_line(tmp_path):
    # JSON escapes a lone UTF-16 surrogate, which json.loads accepts but UTF-8 cannot encode:
    # refused while indexing, not by the tokenizer in a loader thread steps into the run.
    good = json.dumps(record(0))
    messages = [{"role": "user", "content": "broken \ud800"}, {"role": "assistant", "content": "a"}]
    bad = json.dumps({"messages": messages})
    assert "\\ud800" in bad
    path = write_jsonl(tmp_path / "surrogate.jsonl", [good, bad, good, good])
    with pytest.raises(DataError, match=r"surrogate\.jsonl:2: messages\[0\] 'content' holds a "):
        JsonlConversationSource([path])
    source = JsonlConversationSource([path], skip_bad_records=True)
    assert len(source) == 3 and source.num_skipped == 1
    config = DataConfig(
        paths=(path,), seq_len=32, batch_size=3, num_epochs=2, skip_bad_records=True
    )
    assert len(take(make_iterator(config, BYTES), 2)) == 2
    turns = write_jsonl(tmp_path / "turns.jsonl", [json.dumps({"turns": ["q", "a\udc00"]})])
    with pytest.raises(DataError, match=r"turns\.jsonl:1: turns\[1\] holds a lone"):
        JsonlConversationSource([turns], turns="dialogue")


def test_several_files_and_config_errors(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [json.dumps(record(i)) for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [json.dumps(record(i)) for i in range(3, 5)])
    source = JsonlConversationSource([a, b])
    assert len(source) == 5 and source[4]["where"].endswith("b.jsonl:2")
    with pytest.raises(DataError, match="no such file"):
        JsonlConversationSource([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="do not fill one batch"):
        make_iterator(DataConfig(paths=(a,), seq_len=8, batch_size=4, num_epochs=1), BYTES)
    with pytest.raises(DataError, match="seq_len"):
        DataConfig(paths=(a,), seq_len=1, batch_size=1)
    for bad in [(), (8, 4, 16), (4, 4, 16), (1, 16), (4, 8)]:
        with pytest.raises(DataError, match="seq_lens must be strictly ascending"):
            DataConfig(paths=(a,), seq_len=16, seq_lens=bad, batch_size=1)
    assert DataConfig(paths=(a,), seq_len=16, batch_size=1).seq_lens == (16,)
    assert DataConfig(paths=(a,), seq_len=16, seq_lens=[4, 16], batch_size=1).seq_lens == (4, 16)
    with pytest.raises(DataError, match="does not match this process's 2 batch rows"):
        make_iterator(DataConfig(paths=(a,), seq_len=8, batch_size=1), BYTES, BatchRows((0, 1), 2))


def test_data_errors_say_what_is_wrong_with_which_file(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "  "])
    for path in (empty, blank):
        with pytest.raises(DataError, match=f"^{path}: no conversations .*empty or blank lines"):
            JsonlConversationSource([path])
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{}", "not json"])
    with pytest.raises(DataError, match=f"^{bad}: no usable conversations .*2 bad records"):
        JsonlConversationSource([bad], skip_bad_records=True)
    good = write_jsonl(tmp_path / "good.jsonl", [json.dumps(record(0))])
    assert len(JsonlConversationSource([good, empty])) == 1
    with pytest.raises(DataError, match=f"^{tmp_path}: is a folder, not a JSONL file"):
        JsonlConversationSource([str(tmp_path)])


class CountingByteTokenizer(ByteTokenizer):
    calls = 0

    def encode(self, text):
        type(self).calls += 1
        return super().encode(text)


def _settled_tokenizer_calls(tmp_path, lines: int) -> tuple[int, DataConfig]:
    path = tmp_path / f"big{lines}.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "q"}, ASSISTANT_A]}) + "\n"
    path.write_text(line * lines)
    CountingByteTokenizer.calls = 0  # class-level so copies made by the pipeline count too
    tok = CountingByteTokenizer()
    config = DataConfig(paths=(str(path),), seq_len=8, batch_size=4, prefetch_buffer_size=16)
    it = make_iterator(config, tok)
    assert next(it)["tokens"].shape == (4, 8)
    # Prefetch threads keep reading after next() returns, until their buffers are full; count
    # once they have blocked rather than at a racy moment.
    time.sleep(1.0)
    return tok.calls, config


def test_large_file_is_tokenised_lazily(tmp_path):
    big, config = _settled_tokenizer_calls(tmp_path, 100_000)
    small, _ = _settled_tokenizer_calls(tmp_path, 1_000)
    # Two encode calls per conversation; only the read-ahead window has been tokenised, however
    # long the file is.
    assert big <= 2 * (16 + 4 + config.num_threads)
    assert big == small


def test_default_pad_id():
    assert resolve_pad_id(BYTES, None) == 256
    assert resolve_pad_id(BYTES, 0) == 0
    tok = build_chat_tokenizer()
    assert resolve_pad_id(tok, None) == tok.convert_tokens_to_ids("<|endoftext|>")


def test_template_error_names_the_record(dataset_path):
    tok = build_chat_tokenizer(QWEN3_HISTORY_TEMPLATE)
    config = DataConfig(paths=(dataset_path,), seq_len=160, batch_size=12, num_epochs=1)
    with pytest.raises(ChatTemplateError, match=r"conv\.jsonl:\d+: chat template is not prefix"):
        next(make_iterator(config, tok))


def test_source_survives_pickling(dataset_path):
    source = JsonlConversationSource([dataset_path])
    first = source[3]
    copy = pickle.loads(pickle.dumps(source))
    assert copy[3] == first and len(copy) == len(source) == 12


# -- length buckets ----------------------------------------------------------------------------
SEQ_LENS = (24, 48, 64)


def varied_record(i: int) -> dict:
    """Conversation i: a long answer (1..70 characters after a unique start) to a short prompt."""
    answer = f"answer {i}." + "a" * ((i * 37) % 70)
    return {
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]
    }


def identities(batches) -> list[str]:
    """The conversations of the batches, by the start of their answer (kept when truncated)."""
    return [a.split(".")[0] for a in examples(batches)]


@pytest.fixture
def varied_path(tmp_path):
    return write_jsonl(tmp_path / "varied.jsonl", [json.dumps(varied_record(i)) for i in range(40)])


def num_tokens_by_answer(path) -> dict[str, int]:
    source = JsonlConversationSource([path])
    out = {}
    for i in range(len(source)):
        ids, mask = encode_conversation(BYTES, source[i]["messages"])
        out[answers(np.array(ids), np.array(mask)).split(".")[0]] = len(ids)
    return out


def bucketed(path, **kw) -> DataConfig:
    return DataConfig(**{"paths": (path,), "seq_len": 64, "seq_lens": SEQ_LENS, **kw})


def assert_same_batches(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_bucketed_epoch_is_homogeneous_and_complete(varied_path):
    full = num_tokens_by_answer(varied_path)
    per_bucket = np.bincount([bucket_of(n, SEQ_LENS) for n in full.values()], minlength=3)
    assert (per_bucket >= 4).all() and max(full.values()) > 64  # all buckets used, some truncated
    batches = list(make_iterator(bucketed(varied_path, batch_size=4, num_epochs=1), BYTES))
    seen = identities(batches)
    assert len(seen) == len(set(seen)) and set(seen) <= set(full)
    seen_per_bucket = np.zeros(3, int)
    truncated = 0
    for b in batches:
        seq_len = b["tokens"].shape[1]
        assert b["tokens"].shape == b["loss_mask"].shape == (4, seq_len)
        for tokens, mask, length, n in zip(
            b["tokens"], b["loss_mask"], b["length"], b["num_tokens"], strict=True
        ):
            assert full[answers(tokens, mask).split(".")[0]] == n
            assert seq_len == SEQ_LENS[bucket_of(n, SEQ_LENS)]
            assert length == min(n, seq_len) and (tokens[length:] == 256).all()
            truncated += int(n > length)
        seen_per_bucket[SEQ_LENS.index(seq_len)] += 4
    # Each bucket emits full batches only; its last len % batch_size examples are dropped.
    np.testing.assert_array_equal(seen_per_bucket, per_bucket - per_bucket % 4)
    assert truncated == sum(full[a] > 64 for a in seen) > 0


def test_bucketed_batches_are_deterministic(varied_path):
    config = bucketed(varied_path, batch_size=3, seed=4)
    first = take(make_iterator(config, BYTES), 20)
    assert_same_batches(first, take(make_iterator(config, BYTES), 20))
    other = take(make_iterator(bucketed(varied_path, batch_size=3, seed=5), BYTES), 20)
    assert identities(other) != identities(first)
    assert {b["tokens"].shape[1] for b in first} == set(SEQ_LENS)


def test_bucketed_processes_are_disjoint(varied_path):
    config = bucketed(varied_path, batch_size=2, num_epochs=1, seed=3)
    seen = [identities(make_iterator(config, BYTES, BatchRows.of_process(p, 2, 2))) for p in (0, 1)]
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    # Per process at most batch_size - 1 examples per bucket stay in the buffers at the end.
    assert len(seen[0]) + len(seen[1]) >= 40 - 2 * 3


def test_bucketed_resume_with_partially_filled_buffers(varied_path):
    config = bucketed(varied_path, batch_size=5, seed=11)
    it = make_iterator(config, BYTES)
    take(it, 4)
    state = it.get_state()
    assert sum(len(b) for b in state["buffered"]) >= 2
    want = take(it, 12)  # crosses the epoch boundary (40 examples)
    resumed = make_iterator(config, BYTES)
    resumed.set_state(json.loads(json.dumps(state)))
    assert_same_batches(want, take(resumed, 12))
    with pytest.raises(DataError, match="length buckets"):
        make_iterator(bucketed(varied_path, batch_size=5, seq_lens=(48, 64)), BYTES).set_state(
            state
        )


def test_turns_need_declared_roles(tmp_path):
    """An eval prompt file ({"turns"}, user turns only: mt-bench has two per line) is refused as
    training data by default; declared as dialogues, turns alternate user and assistant."""
    mt_bench_like = write_jsonl(
        tmp_path / "mt.jsonl",
        [json.dumps({"turns": [f"Write a poem {i}.", "Now shorten it."]}) for i in range(4)],
    )
    with pytest.raises(DataError, match="mt\\.jsonl:1: .*read as prompts.*--turns dialogue"):
        JsonlConversationSource([mt_bench_like])
    with pytest.raises(DataError, match="turns must be one of"):
        DataConfig(paths=(mt_bench_like,), seq_len=8, batch_size=1, turns="alternating")
    source = JsonlConversationSource([mt_bench_like], turns="dialogue")
    assert [m["role"] for m in source[0]["messages"]] == ["user", "assistant"]
    assert source[0]["messages"][1]["content"] == "Now shorten it."


def test_heldout_split_is_by_content(tmp_path):
    """The held-out part is chosen by a hash of each line's text: disjoint from the training part,
    together all of the data, and the same whatever the order of the lines."""
    lines = [json.dumps(record(i)) for i in range(40)]
    path = write_jsonl(tmp_path / "a.jsonl", lines)
    shuffled = write_jsonl(tmp_path / "b.jsonl", lines[::-1])

    def answers_of(source):
        return {m["content"] for i in range(len(source)) for m in source[i]["messages"][-1:]}

    held = JsonlConversationSource([path], heldout=5, part="heldout")
    train = JsonlConversationSource([path], heldout=5)
    assert (len(held), len(train), held.num_total) == (5, 35, 40)
    assert not answers_of(held) & answers_of(train)
    assert len(answers_of(held) | answers_of(train)) == 40
    assert answers_of(JsonlConversationSource([shuffled], heldout=5, part="heldout")) == (
        answers_of(held)
    )
    with pytest.raises(DataError, match="nothing would be left to train on"):
        JsonlConversationSource([path], heldout=40)
    with pytest.raises(DataError, match="needs heldout > 0"):
        DataConfig(paths=(path,), seq_len=8, batch_size=1, part="heldout")


def test_heldout_part_is_read_by_rows_like_one_process(tmp_path):
    """The evaluation batches of a multi-process run: each process reads its rows of the held-out
    part, repeated forever since it can hold fewer conversations than a global batch; assembled,
    they are the batches one process reads."""
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(record(i)) for i in range(40)])
    config = DataConfig(
        paths=(path,), seq_len=64, batch_size=2, num_epochs=None, heldout=3, part="heldout"
    )
    held = examples(take(make_iterator(dataclasses.replace(config, batch_size=4), BYTES), 3))
    assert len(held) == 12 and len(set(held)) == 3
    assert set(held) == set(examples(take(make_iterator(config, BYTES, BatchRows((0, 1), 2)), 2)))
    seen = [
        examples(take(make_iterator(config, BYTES, BatchRows.of_process(p, 2, 2)), 3))
        for p in range(2)
    ]
    assert held == [e for k in range(3) for p in range(2) for e in seen[p][2 * k : 2 * k + 2]]


def test_conversations_a_chat_template_refuses_are_refused_up_front(tmp_path):
    """An opening assistant message is refused when the files are indexed (file:line), for any
    tokenizer; a conversation the template refuses (here: a multi-turn one that the Qwen3-like
    template rewrites) when the pipeline is built, before a batch is read; with
    skip_bad_records it trains as a no-loss padding row instead."""
    good = [json.dumps(record(2 * i)) for i in range(8)]  # system, user, assistant
    opening = {"messages": [{"role": "assistant", "content": "hi"}, *record(0)["messages"][1:]]}
    path = write_jsonl(tmp_path / "af.jsonl", [*good[:5], json.dumps(opening), *good[5:]])
    with pytest.raises(DataError, match=r"af\.jsonl:6: the conversation starts with an assistant"):
        JsonlConversationSource([path])
    assert len(JsonlConversationSource([path], skip_bad_records=True)) == 8

    multi = write_jsonl(tmp_path / "multi.jsonl", [*good, json.dumps(record(1))])
    tok = build_chat_tokenizer(QWEN3_HISTORY_TEMPLATE)
    config = DataConfig(paths=(multi,), seq_len=160, batch_size=3, num_epochs=1)
    with pytest.raises(ChatTemplateError, match=r"multi\.jsonl:9: chat template is not prefix.*"
                       r"user, assistant, user, assistant.*--skip-bad-records"):
        make_iterator(config, tok)  # building it, before any batch
    skipping = make_iterator(dataclasses.replace(config, skip_bad_records=True), tok)
    batches = take(skipping, 3)
    masks = [row.any() for b in batches for row in b["loss_mask"]]
    assert masks.count(False) == 1 and len(masks) == 9


def test_roles_without_an_assistant_are_named(tmp_path):
    sharegpt = {"messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]}
    path = write_jsonl(tmp_path / "sg.jsonl", [json.dumps(sharegpt)])
    with pytest.raises(DataError, match=r"sg\.jsonl:1: .*roles are 'human', 'gpt'.*rename 'human'"):
        JsonlConversationSource([path])


def test_template_exceptions_are_chat_template_errors():
    alternate = (
        "{%- for m in messages -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{- raise_exception('roles must alternate user/assistant') -}}{%- endif -%}"
        "{{- m['content'] -}}{%- endfor -%}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="refuses the conversation: roles must alternate"):
        encode_conversation(build_chat_tokenizer(alternate), messages)


# Renders an answer holding '</think>' as a reasoning trace, as the real Qwen3 template does:
# with thinking off, such an answer does not follow the generation prompt's empty think block.
THINK_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}{%- set content = message['content'] -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' + content.lstrip() -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def qa(question: str, answer: str) -> str:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages})


def test_answers_the_template_renders_by_their_text_are_checked_up_front(tmp_path, caplog):
    """The template check renders the first conversation of each kind: roles and which of the
    strings the template tests for each message holds. An answer with '</think>' among plain
    ones (same roles) is refused when the pipeline is built, not at the step that reads it."""
    tok = build_chat_tokenizer(THINK_TEMPLATE)
    assert template_markers(tok) == ("</think>", "<think>")
    plain = [qa(f"question {i}", f"answer {i}") for i in range(12)]
    trace = qa("q", "<think>\nreasoning\n</think>\n\nthe answer")
    # as JSON writers may escape it: '\/' and \u escapes still name the marker
    escaped = trace.replace("</think>", "<\\/think>").replace("<think>", "\\u003cthink>")
    for n, line in enumerate((trace, escaped)):
        path = write_jsonl(tmp_path / f"t{n}.jsonl", [*plain[:10], line, *plain[10:]])
        config = DataConfig(paths=(path,), seq_len=128, batch_size=3, num_epochs=1)
        with pytest.raises(
            ChatTemplateError,
            match=rf"t{n}\.jsonl:11: chat template is not prefix-stable .* holds? .*'</think>'"
            r".*--thinking",
        ):
            make_iterator(config, tok)  # building it, before any batch
        # thinking on: the trace follows the generation prompt and trains
        make_iterator(dataclasses.replace(config, enable_thinking=True), tok)
        with caplog.at_level("WARNING", logger="dspark_jax.training.data"):
            skipping = make_iterator(dataclasses.replace(config, skip_bad_records=True), tok)
        assert f"t{n}.jsonl:11" in caplog.text and "1 conversation is of this kind" in caplog.text
        masks = [row.any() for b in take(skipping, 4) for row in b["loss_mask"]]
        assert masks.count(False) == 1
        caplog.clear()
    # every kind refused: nothing would train, even when skipping
    only = write_jsonl(tmp_path / "only.jsonl", [trace] * 4)
    config = DataConfig(paths=(only,), seq_len=128, batch_size=2, skip_bad_records=True)
    with pytest.raises(DataError, match="refuses every kind of conversation"):
        make_iterator(config, tok)


def test_template_markers_cost_a_pass_of_substring_searches(tmp_path, monkeypatch):
    """Grouping 20k plain lines by kind parses none of them again (a text search each); only
    the line holding a marker is parsed (counted, not timed: CI machines are shared)."""
    from dspark_jax.training import data

    lines = [qa(f"q{i}", f"a{i}") for i in range(20000)]
    lines[7] = qa("q7", "<think>a</think>7")
    path = write_jsonl(tmp_path / "many.jsonl", lines)
    source = JsonlConversationSource([path])
    parsed = []
    real = data.parse_record
    monkeypatch.setattr(data, "parse_record", lambda *a: parsed.append(1) or real(*a))
    kinds = conversation_kinds(source, ("</think>", "<think>"))
    assert sorted(count for _, count in kinds.values()) == [1, 19999]
    assert len(parsed) == 1
