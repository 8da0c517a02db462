"""Training input pipeline: JSONL conversations -> padded token batches with an assistant loss mask.

Each JSONL line is one conversation with explicit roles, `{"messages": [{"role", "content"},
...]}` (or DeepSpec's `{"conversations": [...]}`), parsed by `dspark_jax.conversations`. A
`{"turns": [...]}` record is the benchmark prompt format (user turns only) and is refused, since it
holds no answer to train on, unless `DataConfig.turns` declares the turns alternating user and
assistant messages ("dialogue"). Opening the files indexes byte offsets of the lines once and
checks every record (so a bad line is reported before training starts, by file and line);
tokenisation happens lazily, per example, inside the grain map, so nothing tokenised is held in
memory up front.

Held-out split (`DataConfig.heldout` > 0): the conversations whose text has the `heldout` smallest
content hashes are the evaluation set (`part="heldout"`), the rest the training set
(`part="train"`). The split depends only on the text of each line, not on file order or on which
other lines exist, so it is the same on every process and every resume.

The grain pipeline is a random-access `MapDataset`:

    source -> shuffle(seed) -> repeat -> this process's rows -> map(tokenise) -> bucket batches

The shuffled, repeated dataset (reshuffled every epoch) is the global input stream; global batch
k is its examples k*G .. k*G + G - 1 (G the global batch size), and each process reads only the
examples at its rows of every global batch (`BatchRows`: the rows its devices hold in the batch
sharding). With one length bucket the global batch assembled from the processes' batches is
therefore the same whatever the number of processes, and processes holding the same rows (a batch
replicated across hosts) read the same examples. With finite epochs the stream's last
(epochs x conversations) % G examples are dropped. Conversations are never packed together (the
target forward then needs no segment ids).

Length buckets (`DataConfig.seq_lens`, ascending): each conversation is right-padded to the
smallest bucket that holds it; longer ones are truncated to the largest bucket (batches report
the untruncated length, so truncations can be counted). `BucketBatchIterDataset` keeps one buffer
per bucket and emits a batch as soon as a buffer holds `batch_size` examples, so every batch has a
single length and each length compiles one train step. When the data ends (finite `num_epochs`),
the partially filled buffers are dropped: at most `batch_size - 1` examples per bucket. With one
bucket this is plain batching with `drop_remainder`. With several buckets each process buckets its
own examples, so the processes' batches of one step can have different lengths: `global_batch`
pads them to the longest before assembling the global arrays.

Batches are dicts of NumPy arrays, L being the batch's bucket: `tokens` int32 [B, L],
`loss_mask` bool [B, L] (1 on assistant-produced tokens, 0 on padding), `length` int32 [B] and
`num_tokens` int32 [B] (the conversation's length before truncation).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grain
import jax
import numpy as np
from jax.experimental.multihost_utils import process_allgather

from dspark_jax.conversations import (
    TURNS_AS,
    ConversationError,
    is_turns_record,
    parse_line,
    record_messages,
)
from dspark_jax.errors import UserError
from dspark_jax.tokenizer import ByteTokenizer, ChatTemplateError, encode_conversation

if TYPE_CHECKING:
    from dspark_jax.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DataError(UserError):
    """A training record is malformed or the dataset cannot produce batches."""


def check_seq_lens(seq_lens, max_length: int) -> tuple[int, ...]:
    """Length buckets as a tuple: strictly ascending, each >= 2, the last equal to max_length."""
    lens = tuple(int(n) for n in seq_lens)
    if (
        not lens
        or lens[0] < 2
        or any(a >= b for a, b in zip(lens, lens[1:], strict=False))
        or lens[-1] != max_length
    ):
        raise DataError(
            f"seq_lens must be strictly ascending lengths >= 2 ending at the maximum length "
            f"{max_length}, got {tuple(seq_lens)}"
        )
    return lens


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Settings of the training input pipeline.

    `seq_len` is the maximum sequence length. `seq_lens` are the length buckets, strictly
    ascending and ending at `seq_len`; None means the single bucket `(seq_len,)` (and is stored
    as that). `batch_size` is per process (the number of its `BatchRows.rows`). `num_epochs`
    None repeats forever. `pad_id` None pads with the tokenizer's pad token, or EOS when it has
    none. `skip_bad_records` skips malformed lines and records without assistant content (logging
    the count) instead of raising, and trains on conversations the chat template refuses as
    padding with no loss (`tokenize_example`). `turns` says how `{"turns": [...]}` records are read
    (`TURNS_AS`): "prompts" refuses them (user turns only, nothing to train on), "dialogue" reads
    them as alternating user and assistant messages. `heldout` > 0 splits the conversations of
    `paths` (see the module doc) and `part` picks "train" (all but the held-out ones) or
    "heldout".
    """

    paths: tuple[str, ...]
    seq_len: int
    batch_size: int
    seed: int = 0
    num_epochs: int | None = None
    pad_id: int | None = None
    enable_thinking: bool = False
    skip_bad_records: bool = False
    num_threads: int = 4
    prefetch_buffer_size: int = 64
    seq_lens: tuple[int, ...] | None = None
    turns: str = "prompts"
    heldout: int = 0
    part: str = "train"

    def __post_init__(self):
        if isinstance(self.paths, str | os.PathLike):
            object.__setattr__(self, "paths", (os.fspath(self.paths),))
        else:
            object.__setattr__(self, "paths", tuple(os.fspath(p) for p in self.paths))
        if not self.paths:
            raise DataError("DataConfig.paths is empty")
        if self.seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {self.seq_len}")
        seq_lens = (self.seq_len,) if self.seq_lens is None else self.seq_lens
        object.__setattr__(self, "seq_lens", check_seq_lens(seq_lens, self.seq_len))
        if self.batch_size < 1:
            raise DataError(f"batch_size must be positive, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise DataError(f"num_epochs must be positive or None, got {self.num_epochs}")
        if not 0 <= self.seed < 2**32:
            raise DataError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.turns not in TURNS_AS:
            raise DataError(f"turns must be one of {TURNS_AS}, got {self.turns!r}")
        if self.heldout < 0 or self.part not in PARTS:
            raise DataError(
                f"heldout must be >= 0 and part one of {PARTS}: {self.heldout}, {self.part!r}"
            )
        if self.part == "heldout" and not self.heldout:
            raise DataError("part 'heldout' needs heldout > 0")


PARTS = ("train", "heldout")
SHAREGPT_ROLES = ("human", "gpt")
# At most this many conversations (the first of each kind: its sequence of roles and the text the
# template tests for) are rendered through the chat template when a pipeline is built
# (`check_template`).
MAX_TEMPLATE_CHECKS = 256

TURNS_AS_PROMPTS = (
    'a {"turns": [...]} record is read as prompts (user turns only, the format eval and generate '
    "read), so it holds no answer to train on. Give training data with explicit roles, "
    '{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}, or declare that your '
    "turns alternate user and assistant messages with --turns dialogue"
)


def parse_record(line: str | bytes, turns: str = "prompts") -> list[dict[str, str]]:
    """The chat messages of one JSONL line (see `dspark_jax.conversations`), which must hold
    assistant content to train on."""
    try:
        record = parse_line(line)
        messages = record_messages(record, turns=turns)
    except ConversationError as e:
        raise DataError(str(e)) from None
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        if turns == "prompts" and is_turns_record(record):
            raise DataError(TURNS_AS_PROMPTS)
        roles = ", ".join(dict.fromkeys(repr(m["role"]) for m in messages))
        hint = ""
        if {m["role"] for m in messages} & set(SHAREGPT_ROLES):
            hint = " (ShareGPT role names? rename 'human' to 'user' and 'gpt' to 'assistant')"
        raise DataError(
            f"record has no assistant content to train on: its roles are {roles}; training "
            f"reads the roles 'system', 'user' and 'assistant' and learns the non-empty "
            f"'assistant' messages{hint}"
        )
    # The assistant loss mask of a chat template is the span after the generation prompt of the
    # messages before it (tokenizer.encode_conversation): an opening answer has no such span.
    if messages[0]["role"] == "assistant":
        raise DataError(
            "the conversation starts with an assistant message: a chat template cannot render "
            "an answer before any prompt; remove the opening assistant message or put the "
            "message it answers before it"
        )
    return messages


def content_hash(raw: bytes) -> int:
    """A stable 64-bit hash of one JSONL line's text (surrounding whitespace ignored)."""
    return int.from_bytes(hashlib.blake2b(raw.strip(), digest_size=8).digest(), "little")


def heldout_mask(hashes: np.ndarray, count: int) -> np.ndarray:
    """Which conversations form the held-out set: the `count` smallest hashes (ties by index)."""
    mask = np.zeros(len(hashes), bool)
    if count:
        mask[np.lexsort((np.arange(len(hashes)), hashes))[:count]] = True
    return mask


class JsonlConversationSource:
    """Random-access grain source over the conversations of JSONL files.

    Indexes and validates every line once; elements are `{"messages": [...], "where": "file:line"}`
    read back from disk on access. Blank lines are ignored; files without a single conversation
    between them are refused. `turns` as in `DataConfig`; with `heldout` > 0 the source holds
    only its `part` of the split (see the module doc), and `num_total` counts the conversations
    of both parts. `fingerprint` identifies the text of all of them in order (whatever the
    files are called), so that a resumed run can tell it reads the data it started on.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        skip_bad_records: bool = False,
        *,
        turns: str = "prompts",
        heldout: int = 0,
        part: str = "train",
    ):
        self._paths = [os.fspath(p) for p in paths]
        self._turns = turns
        starts, ends, files, lines, hashes = [], [], [], [], []
        self.num_skipped = 0
        # The sequences of roles of the conversations (`role_sequences`), by index in
        # `_role_ids`: what `check_template` groups the conversations by.
        self.role_sequences: list[tuple[str, ...]] = []
        role_index: dict[tuple[str, ...], int] = {}
        role_ids = []
        fingerprint = hashlib.blake2b(digest_size=16)
        for file_index, path in enumerate(self._paths):
            if os.path.isdir(path):
                raise DataError(f"{path}: is a folder, not a JSONL file")
            if not os.path.isfile(path):
                raise DataError(f"{path}: no such file")
            offset = 0
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    start, offset = offset, offset + len(raw)
                    if not raw.strip():
                        continue
                    try:
                        roles = tuple(m["role"] for m in parse_record(raw, turns))
                    except DataError as e:
                        if not skip_bad_records:
                            raise DataError(f"{path}:{line_no}: {e}") from None
                        self.num_skipped += 1
                        continue
                    fingerprint.update(raw.strip() + b"\n")
                    role_ids.append(role_index.setdefault(roles, len(role_index)))
                    starts.append(start)
                    ends.append(offset)
                    files.append(file_index)
                    lines.append(line_no)
                    if heldout:
                        hashes.append(content_hash(raw))
        if self.num_skipped:
            logger.warning("skipped %d bad records in %s", self.num_skipped, self._paths)
        self.num_total = len(starts)
        self.fingerprint = fingerprint.hexdigest()
        if not self.num_total:
            files = ", ".join(self._paths)
            if self.num_skipped:
                raise DataError(
                    f"{files}: no usable conversations ({self.num_skipped} bad records skipped)"
                )
            raise DataError(f"{files}: no conversations (empty or blank lines only)")
        keep = np.ones(self.num_total, bool)
        if heldout:
            if heldout >= self.num_total:
                raise DataError(
                    f"cannot hold out {heldout} of the {self.num_total} conversations in "
                    f"{self._paths}: nothing would be left to train on"
                )
            held = heldout_mask(np.asarray(hashes, np.uint64), heldout)
            keep = held if part == "heldout" else ~held
        self._starts = np.asarray(starts, np.int64)[keep]
        self._ends = np.asarray(ends, np.int64)[keep]
        self._files = np.asarray(files, np.int32)[keep]
        self._lines = np.asarray(lines, np.int64)[keep]
        self._role_ids = np.asarray(role_ids, np.int32)[keep]
        self.role_sequences = list(role_index)
        self._fds: dict[int, int] = {}
        self._fd_pid = os.getpid()
        self._fd_lock = threading.Lock()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._paths)

    @property
    def turns(self) -> str:
        return self._turns

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = f"{self._paths[int(self._files[index])]}:{int(self._lines[index])}"
        try:
            messages = parse_record(self.raw(index), self._turns)
        except DataError as e:
            raise DataError(f"{where}: {e} (was the file modified after indexing?)") from None
        return {"messages": messages, "where": where}

    def role_ids(self) -> np.ndarray:
        """Per conversation, the index of its sequence of roles in `role_sequences`."""
        return self._role_ids

    def raw(self, index: int) -> bytes:
        """The JSONL line of conversation `index`, as the file holds it."""
        file_index = int(self._files[index])
        start, end = int(self._starts[index]), int(self._ends[index])
        return os.pread(self._fd(file_index), end - start, start)

    def _fd(self, file_index: int) -> int:
        # pread on one descriptor per file is safe across grain's reader threads; a forked or
        # unpickled copy opens its own.
        with self._fd_lock:
            if self._fd_pid != os.getpid():
                self._fds, self._fd_pid = {}, os.getpid()
            if file_index not in self._fds:
                self._fds[file_index] = os.open(self._paths[file_index], os.O_RDONLY)
            return self._fds[file_index]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"] = {}
        del state["_fd_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fd_lock = threading.Lock()

    def __del__(self):
        if getattr(self, "_fd_pid", None) == os.getpid():
            for fd in self._fds.values():
                os.close(fd)

    def __repr__(self) -> str:
        return f"JsonlConversationSource({self._paths}, {len(self)} conversations)"


def resolve_pad_id(tokenizer: Tokenizer, pad_id: int | None) -> int:
    """`pad_id`, else the tokenizer's pad token, else its EOS."""
    for candidate in (pad_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise DataError("no pad_id given and the tokenizer has neither a pad nor an EOS token")


def bucket_of(num_tokens: int, seq_lens: Sequence[int]) -> int:
    """Index of the smallest of the ascending `seq_lens` holding `num_tokens` (else the last)."""
    return min(bisect.bisect_left(seq_lens, num_tokens), len(seq_lens) - 1)


SKIP_BAD_RECORDS_HINT = (
    "fix or remove such conversations, or pass --skip-bad-records (TrainConfig."
    "skip_bad_records) to train without them (each then fills its batch slot with padding "
    "that carries no loss)"
)


def tokenize_example(
    example: Mapping[str, Any],
    tokenizer: Tokenizer,
    seq_lens: Sequence[int],
    pad_id: int,
    enable_thinking: bool = False,
    skip_bad_records: bool = False,
) -> dict[str, np.ndarray]:
    """One conversation -> `tokens`, `loss_mask`, `length`, `num_tokens` (see the module doc).

    The arrays are right-padded to the smallest of the ascending `seq_lens` that holds the
    conversation, or truncated to the largest. A conversation the chat template refuses raises
    ChatTemplateError, or with `skip_bad_records` becomes padding of the smallest length with no
    loss (a warning names it), so that the batches, and a resumed run's data position, stay
    as they are.
    """
    where = example.get("where", "<conversation>")
    try:
        ids, mask = encode_conversation(tokenizer, example["messages"], enable_thinking)
    except ChatTemplateError as e:
        if not skip_bad_records:
            raise ChatTemplateError(f"{where}: {e}; {SKIP_BAD_RECORDS_HINT}") from None
        logger.warning("skipping %s (no loss): %s", where, e)
        ids = [pad_id] * seq_lens[0]
        mask = [0] * seq_lens[0]
    seq_len = seq_lens[bucket_of(len(ids), seq_lens)]
    length = min(len(ids), seq_len)
    tokens = np.full(seq_len, pad_id, np.int32)
    tokens[:length] = ids[:length]
    loss_mask = np.zeros(seq_len, bool)
    loss_mask[:length] = np.asarray(mask[:length], bool)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "length": np.int32(length),
        "num_tokens": np.int32(len(ids)),
    }


def _stack(examples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class BucketBatchIterDataset(grain.IterDataset):
    """Batches of `batch_size` examples of one length, from a MapDataset of tokenised examples.

    `examples` is read in order (through `read_options`' threads); each example joins the buffer
    of its length (`len(tokens)`, one of `seq_lens`) and a full buffer is emitted as a batch. The
    iterator state is the reader's position plus the positions in `examples` of the buffered
    examples, not the examples themselves: a buffer can hold `batch_size - 1` sequences of the
    largest length, too much for a JSON checkpoint. Restoring re-reads (re-tokenises) them, which
    is exact because `examples` is deterministic random access.
    """

    def __init__(
        self,
        examples: grain.MapDataset,
        batch_size: int,
        seq_lens: Sequence[int],
        read_options: grain.ReadOptions | None = None,
    ):
        super().__init__(examples.map_with_index(_with_index).to_iter_dataset(read_options))
        self._examples = examples
        self._batch_size = batch_size
        self._seq_lens = tuple(seq_lens)

    def __iter__(self) -> grain.DatasetIterator:
        return _BucketBatchIterator(
            self._parent.__iter__(), self._examples, self._batch_size, self._seq_lens
        )

    def __str__(self) -> str:
        return f"BucketBatchIterDataset(batch_size={self._batch_size}, seq_lens={self._seq_lens})"


def _with_index(index: int, example: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
    return index, example


class _BucketBatchIterator(grain.DatasetIterator):
    def __init__(
        self,
        parent: grain.DatasetIterator,
        examples: grain.MapDataset,
        batch_size: int,
        seq_lens: tuple[int, ...],
    ):
        super().__init__(parent)
        self._examples = examples
        self._batch_size = batch_size
        self._seq_lens = seq_lens
        self._buffers: dict[int, list[tuple[int, dict[str, np.ndarray]]]] = {
            n: [] for n in seq_lens
        }

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            # StopIteration at the end of the data drops the partially filled buffers.
            index, example = next(self._parent)
            buffer = self._buffer_of(index, example)
            buffer.append((index, example))
            if len(buffer) == self._batch_size:
                batch = _stack([e for _, e in buffer])
                buffer.clear()
                return batch

    def _buffer_of(self, index: int, example: Mapping[str, np.ndarray]) -> list:
        n = len(example["tokens"])
        if n not in self._buffers:
            raise DataError(f"example {index} has length {n}, not one of {self._seq_lens}")
        return self._buffers[n]

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._parent.get_state(),
            "seq_lens": list(self._seq_lens),
            "buffered": [[i for i, _ in self._buffers[n]] for n in self._seq_lens],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if list(state["seq_lens"]) != list(self._seq_lens):
            raise DataError(
                f"iterator state has length buckets {state['seq_lens']}, this pipeline "
                f"{list(self._seq_lens)}"
            )
        self._parent.set_state(state["parent"])
        for n, indices in zip(self._seq_lens, state["buffered"], strict=True):
            restored = [(int(i), self._examples[int(i)]) for i in indices]
            if any(len(e["tokens"]) != n for _, e in restored):
                raise DataError(
                    f"buffered examples {list(indices)} no longer have length {n} (was the data "
                    "or the tokenizer changed?)"
                )
            self._buffers[n] = restored

    def __str__(self) -> str:
        return "BucketBatchDatasetIterator"


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """The rows of every global batch of `global_size` examples that one process supplies.

    `rows` ascend: that is the order in which `jax.make_array_from_process_local_data` places a
    process's local rows.
    """

    rows: tuple[int, ...]
    global_size: int

    def __post_init__(self):
        rows = tuple(int(r) for r in self.rows)
        object.__setattr__(self, "rows", rows)
        if not rows or any(a >= b for a, b in zip(rows, rows[1:], strict=False)):
            raise DataError(f"batch rows must be ascending and non-empty, got {rows}")
        if rows[0] < 0 or rows[-1] >= self.global_size:
            raise DataError(f"batch rows {rows} are not rows of a batch of {self.global_size}")

    @classmethod
    def of_process(cls, process_index: int, process_count: int, batch_size: int) -> BatchRows:
        """Process `process_index`'s contiguous block of `batch_size` rows: the rows a mesh whose
        batch axes run over the processes' devices in process order gives it."""
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} not in [0, {process_count})")
        start = process_index * batch_size
        return cls(tuple(range(start, start + batch_size)), batch_size * process_count)


class _BatchRowsMapDataset(grain.MapDataset):
    """Element i is the parent's element at row `rows[i % b]` of global batch `i // b`."""

    _MUTATES_ELEMENT_SPEC = False

    def __init__(self, parent: grain.MapDataset, rows: BatchRows):
        super().__init__(parent)
        self._rows = rows.rows
        self._global_size = rows.global_size
        self._length = len(parent) // rows.global_size * len(rows.rows)

    def __len__(self) -> int:
        return self._length

    def _parent_index(self, index: int) -> int:
        batch, row = divmod(index, len(self._rows))
        return batch * self._global_size + self._rows[row]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[self._parent_index(index)]

    def _getitems(self, indices: Sequence[int]):
        return self._parent._getitems([self._parent_index(i) for i in indices])

    def __str__(self) -> str:
        return f"BatchRowsMapDataset(rows={self._rows}, global_size={self._global_size})"


# String methods (and filters) whose arguments are text a template looks for in a message.
_TEXT_TESTS = frozenset(
    ("split", "rsplit", "partition", "rpartition", "startswith", "endswith", "find", "rfind",
     "index", "rindex", "count", "replace", "removeprefix", "removesuffix")
)


def template_markers(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The strings a tokenizer's chat template tests message text for: the constants of its
    substring tests (`'</think>' in content`) and of the string methods it calls
    (`content.split('</think>')`, `.startswith('<tool_response>')`), whitespace-only ones
    aside. A conversation holding one may render differently from one that does not (the real
    Qwen3 template renders an answer with `</think>` as a reasoning trace)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, Mapping):  # named templates
        sources = [t for t in source.values() if isinstance(t, str)]
    else:
        sources = [source] if isinstance(source, str) else []
    import jinja2
    from jinja2 import nodes

    found = []
    for text in sources:
        try:
            tree = jinja2.Environment().parse(text)
        except jinja2.TemplateError:
            continue  # rendering says what is wrong with it
        for node in tree.find_all((nodes.Compare, nodes.Call, nodes.Filter)):
            if isinstance(node, nodes.Compare):
                if any(op.op in ("in", "notin") for op in node.ops):
                    found.append(node.expr)
            elif isinstance(node, nodes.Call):
                if isinstance(node.node, nodes.Getattr) and node.node.attr in _TEXT_TESTS:
                    found += node.args
            elif node.name in _TEXT_TESTS:
                found += node.args
    markers = (
        n.value
        for n in found
        if isinstance(n, nodes.Const) and isinstance(n.value, str) and n.value.strip()
    )
    return tuple(dict.fromkeys(markers))


def _verbatim_cores(marker: str) -> bytes:
    """The longest run of `marker` that a JSON line without \\u escapes holds as it is (JSON
    escapes quotes, backslashes, control characters and perhaps '/'), in UTF-8."""
    runs = re.split(r'["\\/\x00-\x1f\x7f]', marker)
    return max(runs, key=len).encode("utf-8")


def conversation_kinds(
    source: JsonlConversationSource, markers: Sequence[str]
) -> dict[tuple[int, tuple[frozenset[str], ...] | None], list[int]]:
    """The conversations of `source` by kind, in order of first appearance: the kind is the
    sequence of roles and which of `markers` each message contains (None: none at all); each
    kind maps to [index of its first conversation, number of conversations].

    Only the lines whose text might hold a marker are parsed again, so this costs a pass of
    substring searches over the files (about half a second per 100k short lines)."""
    role_ids = source.role_ids()
    kinds: dict[tuple[int, tuple[frozenset[str], ...] | None], list[int]] = {}
    if not markers:
        ids, first, counts = np.unique(role_ids, return_index=True, return_counts=True)
        for i in np.argsort(first):
            kinds[(int(ids[i]), None)] = [int(first[i]), int(counts[i])]
        return kinds
    cores = list(dict.fromkeys(_verbatim_cores(m) for m in markers))
    scan_all = not all(cores)
    for index in range(len(source)):
        marked = None
        raw = source.raw(index)
        if scan_all or b"\\u" in raw or any(c in raw for c in cores):
            messages = parse_record(raw, source.turns)
            found = tuple(
                frozenset(m for m in markers if m in message["content"]) for message in messages
            )
            if any(found):
                marked = found
        kind = (int(role_ids[index]), marked)
        if kind in kinds:
            kinds[kind][1] += 1
        else:
            kinds[kind] = [index, 1]
    return kinds


def check_template(
    source: JsonlConversationSource,
    tokenizer: Tokenizer,
    enable_thinking: bool = False,
    skip_bad_records: bool = False,
) -> None:
    """Renders the first conversation of each kind in `source` through `tokenizer`'s chat
    template, so that a template that refuses a kind of conversation (roles it does not accept
    or that must alternate, multi-turn conversations it rewrites, answers it renders by their
    text) stops the run when its pipeline is built rather than at the step that reads one.
    With `skip_bad_records` it warns instead, counting the conversations of the refused kinds:
    those the template refuses are skipped as they are read. Refused too: data whose every kind
    of conversation the template refuses, since nothing would be left to train on.

    A kind (`conversation_kinds`) is a sequence of roles together with which of the template's
    markers (`template_markers`, such as '</think>') each message holds: what a template does
    depends on those far more than on the rest of the text, and a data set has few kinds, so
    this costs a few renders and a pass of substring searches however large the data is
    (rendering every conversation would cost ~0.4-1 ms per conversation, a minute or more for
    100k of them).
    """
    if isinstance(tokenizer, ByteTokenizer):
        return  # the byte models concatenate the contents: every conversation encodes
    markers = template_markers(tokenizer)
    kinds = conversation_kinds(source, markers)
    refused = 0
    for (_, marked), (index, count) in list(kinds.items())[:MAX_TEMPLATE_CHECKS]:
        example = source[index]
        try:
            encode_conversation(tokenizer, example["messages"], enable_thinking)
        except ChatTemplateError as e:
            refused += 1
            roles = ", ".join(m["role"] for m in example["messages"])
            holds = ""
            if marked is not None:
                holds = "; its messages hold " + ", ".join(
                    f"{' and '.join(map(repr, sorted(m)))} (message {i})"
                    for i, m in enumerate(marked)
                    if m
                )
                if not enable_thinking and any("think" in t for m in marked for t in m):
                    holds += (
                        ", rendered with thinking off: to train on reasoning traces, pass "
                        "--thinking (TrainConfig.enable_thinking)"
                    )
            message = (
                f"{example['where']}: {e} (the chat template is checked on the first "
                f"conversation of each kind, by its roles and the text the template tests for; "
                f"this one has roles {roles}{holds}; {count} conversation"
                f"{'s are' if count > 1 else ' is'} of this kind)"
            )
            if not skip_bad_records:
                raise ChatTemplateError(f"{message}; {SKIP_BAD_RECORDS_HINT}") from None
            logger.warning(
                "%s; such conversations are skipped as they are read (trained as padding with "
                "no loss)",
                message,
            )
    if len(kinds) > MAX_TEMPLATE_CHECKS:
        logger.warning(
            "%s: %d kinds of conversations (roles and the text the chat template tests for); "
            "the first %d were checked against the template, a conversation of the others that "
            "it refuses stops the run when it is read",
            ", ".join(source.paths),
            len(kinds),
            MAX_TEMPLATE_CHECKS,
        )
    elif refused and refused == len(kinds):
        raise DataError(
            f"{', '.join(source.paths)}: the chat template refuses every kind of conversation "
            "of the data (see the warnings above): nothing would be left to train on"
        )


def make_dataset(
    source: Sequence[Any],
    tokenizer: Tokenizer,
    config: DataConfig,
    rows: BatchRows,
) -> grain.MapDataset:
    """The shuffled, repeated, tokenised grain MapDataset of one process's examples (`rows`)."""
    if len(rows.rows) != config.batch_size:
        raise DataError(
            f"batch_size {config.batch_size} does not match this process's {len(rows.rows)} "
            "batch rows"
        )
    if not len(source):
        raise DataError("no conversations to train on")
    epochs = config.num_epochs
    if epochs is not None and len(source) * epochs < rows.global_size:
        raise DataError(
            f"{len(source)} conversations x {epochs} epochs do not fill one batch of "
            f"{rows.global_size} (the global batch)"
        )
    pad_id = resolve_pad_id(tokenizer, config.pad_id)

    if isinstance(source, JsonlConversationSource):
        check_template(source, tokenizer, config.enable_thinking, config.skip_bad_records)

    def tokenize(example: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return tokenize_example(
            example,
            tokenizer,
            config.seq_lens,
            pad_id,
            config.enable_thinking,
            config.skip_bad_records,
        )

    ds = grain.MapDataset.source(source).shuffle(seed=config.seed).repeat(epochs)
    return _BatchRowsMapDataset(ds, rows).map(tokenize)


def open_source(config: DataConfig) -> JsonlConversationSource:
    """The conversations of `config.paths` (its `part` of them), indexed and checked."""
    return JsonlConversationSource(
        config.paths,
        config.skip_bad_records,
        turns=config.turns,
        heldout=config.heldout,
        part=config.part,
    )


def make_iterator(
    config: DataConfig,
    tokenizer: Tokenizer,
    rows: BatchRows | None = None,
    source: JsonlConversationSource | None = None,
) -> grain.DatasetIterator:
    """A checkpointable iterator of this process's length-bucketed batches.

    `get_state()` / `set_state()` resume exactly (the state is JSON-serialisable). `rows` default
    to this process's contiguous block (`BatchRows.of_process` of jax's process index and count);
    pass other rows to simulate several processes. `source`: `open_source(config)` when already
    opened (indexing reads every line of the files).
    """
    if rows is None:
        rows = BatchRows.of_process(jax.process_index(), jax.process_count(), config.batch_size)
    if source is None:
        source = open_source(config)
    examples = make_dataset(source, tokenizer, config, rows)
    options = grain.ReadOptions(
        num_threads=config.num_threads, prefetch_buffer_size=config.prefetch_buffer_size
    )
    return iter(BucketBatchIterDataset(examples, config.batch_size, config.seq_lens, options))


def pad_batch(batch: Mapping[str, np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """`batch` right-padded to `seq_len` positions (pad tokens, no loss; lengths unchanged)."""
    extra = seq_len - batch["tokens"].shape[1]
    if extra < 0:
        raise DataError(f"cannot pad a batch of length {batch['tokens'].shape[1]} to {seq_len}")
    padded = dict(batch)
    padded["tokens"] = np.pad(batch["tokens"], ((0, 0), (0, extra)), constant_values=pad_id)
    padded["loss_mask"] = np.pad(batch["loss_mask"], ((0, 0), (0, extra)))
    return padded


def global_batch(
    local: Mapping[str, np.ndarray],
    shardings: Mapping[str, jax.sharding.Sharding],
    pad_id: int | None = None,
) -> dict[str, jax.Array]:
    """The global arrays (one per key of `shardings`) assembled from every process's `local` batch.

    Give `pad_id` when batches come from several length buckets: several processes then agree on
    the longest of their batches' lengths with a host all-gather and pad to it, since every
    process must build the same global shape.
    """
    if pad_id is not None and jax.process_count() > 1:
        lengths = process_allgather(np.asarray(local["tokens"].shape[1], np.int32))
        local = pad_batch(local, int(np.max(lengths)), pad_id)
    return {
        k: jax.make_array_from_process_local_data(shardings[k], np.asarray(local[k]))
        for k in shardings
    }
