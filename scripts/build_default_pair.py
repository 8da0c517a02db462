"""Builds the embedded default model pair from a corpus any Debian + PyPI machine has offline.

    apt-get install -y python3-doc        # the Python documentation as HTML
    python scripts/build_default_pair.py --out runs/default-pair --jobs 2 \
        --ship dspark_jax/assets/default

The default `--preset full` is the shipped pair's recipe: about 45 minutes on a quiet 2-core CPU
(the same JAX version reproduces the shipped target bit for bit), a few on a GPU. `--preset quick`
runs every stage on smaller budgets in about 15 minutes, for a weaker pair.

Stages, each written under --out and skipped when its output already exists (so an interrupted
run continues where it stopped; delete a stage's folder to redo it):

1. corpus/     chat conversations mined from the local Python: "Write a Python function that
               <docstring summary>" -> the function's source, for every documented function of
               the standard library; and "Explain <section title>." -> the section's text, for the
               HTML documentation of Debian's python3-doc. A deterministic held-out split (by
               module and by page, so the two splits share no file) and held-out prompt files.
2. tokenizer/  a byte-level BPE trained with `tokenizers` on the training split, with Qwen3's
               control tokens, a spare `<|mask|>` for the drafters and a Qwen3-like chat template
               that honours `enable_thinking`; a Hugging Face tokenizer folder.
3. target/     a Qwen3-architecture causal LM (`dspark_jax.models.qwen3.Qwen3`, optax AdamW)
               pretrained on the packed, chat-rendered training split and written in the Hugging
               Face layout (config.json, model.safetensors, generation_config.json, tokenizer),
               then checked once against transformers' Qwen3ForCausalLM.
4. drafters/   a DSpark and a DFlash drafter trained for it by `dspark-jax train` with the same
   dspark,     budget (config files written here) on the corpus, exported and cast like the
   dflash      target.
5. corpus/distill.jsonl  the target's own greedy answers to a seeded sample of training prompts
               (`dspark-jax generate --no-draft`).
6. drafters/   each phase-4 drafter fine-tuned on those answers, again with equal budgets: the
   *-distilled final drafters.
7. summary.json  sizes, timings, the commands run and the held-out losses; the tables of
               docs/results.md come from benchmarks/default_pair_results.py over this folder.
8. --ship DIR  copies the target (with its tokenizer) and the final DSpark drafter to DIR, e.g.
               the package's dspark_jax/assets/default.

Everything runs on the default JAX device (a GPU when one is installed) with the same number of
steps, so a CPU and a GPU run follow the same recipe. The shipped pair is stored in bfloat16 to
keep the package small; training runs in float32.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import html.parser
import json
import pprint
import re
import subprocess
import sys
import sysconfig
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

DOCS_HTML = Path("/usr/share/doc/python3-doc/html")
MISSING_DOCS = (
    "{docs} is missing: install the Python documentation (apt-get install -y python3-doc)"
)
HELD_OUT_MODULUS = 12  # one module / page in 12 is held out

# Folders of the standard library that hold tests, bundled wheels or third-party packages.
STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "_bundled",
    "turtledemo",
    "lib2to3",
}
MAX_FUNCTION_CHARS = 1800
MAX_SECTION_CHARS = 1500
MIN_SECTION_CHARS = 200
DOC_SKIP_PAGES = {
    "genindex.html",
    "py-modindex.html",
    "search.html",
    "contents.html",
    "copyright.html",
    "license.html",
    "bugs.html",
    "about.html",
    "glossary.html",
}


def held_out(key: str) -> bool:
    return zlib.crc32(key.encode()) % HELD_OUT_MODULUS == 0


# -- corpus: documented functions of the standard library --------------------------------------
# Imperative verbs that commonly open docstring summaries in CPython's standard library; "Write a
# Python function that" + the verb in the third person reads like the default prompt. Summaries
# that open with anything else keep their wording after a colon.
SUMMARY_VERBS = frozenset(
    """return set create get read add construct handle parse remove initialize convert write
    find send process close format delete open run generate make copy print check clear wait
    configure decode update encode stop replace load bind call start extract log try register
    change produce insert compute determine put execute receive reset turn query display ensure
    retrieve show split build append apply fetch flush emit raise release acquire install accept
    validate match search compare test iterate yield save store lookup look skip move mark push
    pop join strip escape quote unquote normalize resolve translate transform filter sort select
    enable disable allow connect disconnect dispatch forward schedule cancel finish complete
    collect count measure calculate evaluate compile import export wrap unwrap pack unpack
    serialize deserialize dump restore repeat fill draw render pad truncate shorten expand
    tokenize scan list walk visit""".split()
)


def third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in tuple("aeiou"):
        return verb[:-1] + "ies"
    return verb + "s"


def function_instruction(summary: str, is_method: bool) -> str:
    kind = "method" if is_method else "function"
    first, _, rest = summary.partition(" ")
    word = first.lower()
    if word in SUMMARY_VERBS and first[:1].isupper():
        return f"Write a Python {kind} that {third_person(word)} {rest}".rstrip()
    if word.endswith("s") and word[:-1] in SUMMARY_VERBS and first[:1].isupper():
        return f"Write a Python {kind} that {word} {rest}".rstrip()
    return f"Write a Python {kind} for this description: {summary}"


def docstring_summary(doc: str) -> str | None:
    """The first paragraph of a docstring on one line, or None when it is no sentence."""
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    words = [w for w in summary.split() if sum(ch.isalpha() for ch in w) >= 2]
    if not 3 <= len(words) <= 40 or not summary[:1].isalpha() or ">>>" in summary:
        return None
    return summary.rstrip(".") + "."


def stdlib_files() -> Iterator[tuple[str, Path]]:
    """(module name, path) of the standard library's Python files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if STDLIB_SKIP & set(parts):
            continue
        yield ".".join(parts)[: -len(".py")], path


def function_conversations(module: str, source: str) -> Iterator[dict]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    methods = {
        id(f)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        summary = docstring_summary(doc) if doc else None
        if summary is None or node.name.startswith("test"):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])).strip("\n")
        if len(code) > MAX_FUNCTION_CHARS or "\t" in code:
            continue
        yield {
            "source": f"{module}:{node.lineno}",
            "messages": [
                {"role": "user", "content": function_instruction(summary, id(node) in methods)},
                {"role": "assistant", "content": code},
            ],
        }


# -- corpus: the HTML documentation ------------------------------------------------------------
_BLOCK_TAGS = {"p", "pre", "li", "dt", "dd", "tr", "blockquote", "h1", "h2", "h3", "h4", "h5"}
_HEADINGS = {"h1", "h2", "h3"}
_VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "col", "wbr"}


class _DocPage(html.parser.HTMLParser):
    """Sections (title, [blocks]) of the main body of a Sphinx HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: list[tuple[str, list[str]]] = []
        self._body_depth = 0  # > 0 inside <div role="main">
        self._skip_depth = 0  # > 0 inside permalink anchors
        self._pre = 0
        self._heading: list[str] | None = None
        self._text: list[str] = []
        self._title = ""
        self._blocks: list[str] = []
        self._prefix = ""

    def handle_starttag(self, tag, attrs):
        if tag in _VOID_TAGS:
            return
        attrs = dict(attrs)
        if self._body_depth == 0:
            if tag == "div" and attrs.get("role") == "main":
                self._body_depth = 1
            return
        self._body_depth += 1
        if self._skip_depth or "headerlink" in (attrs.get("class") or ""):
            self._skip_depth += 1
            return
        if tag in _HEADINGS:
            self._flush_block()
            self._flush_section()
            self._heading = []
        elif tag in _BLOCK_TAGS:
            self._flush_block()
            self._prefix = "- " if tag == "li" else ""
        if tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag):
        if tag in _VOID_TAGS or self._body_depth == 0:
            return
        self._body_depth -= 1
        if self._skip_depth:
            self._skip_depth -= 1
            return
        if tag in _HEADINGS and self._heading is not None:
            title = " ".join("".join(self._heading).split())
            self._title = re.sub(r"^[\d.]+\s+", "", title).rstrip(".")
            self._heading = None
        elif tag in _BLOCK_TAGS:
            self._flush_block()
        if tag == "pre":
            self._pre -= 1

    def handle_data(self, data):
        if self._body_depth == 0 or self._skip_depth:
            return
        if self._heading is not None:
            self._heading.append(data)
        else:
            self._text.append(data)

    def _flush_block(self):
        text = "".join(self._text)
        self._text = []
        text = text.strip("\n") if self._pre else " ".join(text.split())
        if text.strip():
            self._blocks.append(self._prefix + text)
        self._prefix = ""

    def _flush_section(self):
        if self._title and self._blocks:
            self.sections.append((self._title, self._blocks))
        self._blocks = []

    def close(self):
        super().close()
        self._flush_block()
        self._flush_section()


DOC_PROMPTS = (
    "Explain {title}.",
    "What does the Python documentation say about {title}?",
    "Tell me about {title} in Python.",
)


def section_chunks(blocks: list[str]) -> Iterator[str]:
    """The blocks of a section joined into pieces of at most MAX_SECTION_CHARS (a longer single
    block is cut at a line or word boundary)."""
    piece: list[str] = []
    size = 0
    for block in blocks:
        while len(block) > MAX_SECTION_CHARS:
            cut = block.rfind("\n", 0, MAX_SECTION_CHARS)
            if cut <= 0:
                cut = block.rfind(" ", 0, MAX_SECTION_CHARS)
            if cut <= 0:
                cut = MAX_SECTION_CHARS
            head, block = block[:cut], block[cut:].lstrip()
            if piece:
                yield "\n\n".join(piece)
                piece, size = [], 0
            yield head
        if piece and size + len(block) + 2 > MAX_SECTION_CHARS:
            yield "\n\n".join(piece)
            piece, size = [], 0
        piece.append(block)
        size += len(block) + 2
    if piece:
        yield "\n\n".join(piece)


def doc_conversations(page: str, text: str) -> Iterator[dict]:
    parser = _DocPage()
    parser.feed(text)
    parser.close()
    for s, (title, blocks) in enumerate(parser.sections):
        for c, chunk in enumerate(section_chunks(blocks)):
            if len(chunk) < MIN_SECTION_CHARS:
                continue
            key = f"{page}#{s}.{c}"
            if title.endswith("?"):
                prompt = "{title}" if c == 0 else "{title} Tell me more."
            elif c == 0:
                prompt = DOC_PROMPTS[zlib.crc32(key.encode()) % len(DOC_PROMPTS)]
            else:
                prompt = "Tell me more about {title}."
            yield {
                "source": key,
                "messages": [
                    {"role": "user", "content": prompt.format(title=title)},
                    {"role": "assistant", "content": chunk},
                ],
            }


def doc_pages(docs: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(docs.rglob("*.html")):
        rel = path.relative_to(docs).as_posix()
        if rel.startswith("_") or path.name in DOC_SKIP_PAGES:
            continue
        yield rel, path


def build_corpus(out: Path, docs: Path, num_eval_prompts: int) -> dict:
    """Writes train.jsonl / eval.jsonl ({"messages": ...}) and the held-out prompt files."""
    if not docs.is_dir():
        raise SystemExit(MISSING_DOCS.format(docs=docs))
    splits: dict[str, dict[str, list[dict]]] = {"train": {}, "eval": {}}
    for module, path in stdlib_files():
        split = "eval" if held_out(module) else "train"
        text = path.read_text(encoding="utf-8", errors="replace")
        splits[split].setdefault("code", []).extend(function_conversations(module, text))
    for page, path in doc_pages(docs):
        split = "eval" if held_out(page) else "train"
        text = path.read_text(encoding="utf-8", errors="replace")
        splits[split].setdefault("docs", []).extend(doc_conversations(page, text))

    out.mkdir(parents=True, exist_ok=True)
    stats = {}
    for split, kinds in splits.items():
        with open(out / f"{split}.jsonl", "w") as f:
            for kind in sorted(kinds):
                for conv in kinds[kind]:
                    f.write(json.dumps({"messages": conv["messages"], "source": conv["source"]}))
                    f.write("\n")
        stats[split] = {kind: len(convs) for kind, convs in kinds.items()}
        stats[split]["chars"] = sum(
            len(m["content"]) for convs in kinds.values() for c in convs for m in c["messages"]
        )
    # Prompts for decoding, evenly spaced picks from each kind of the held-out split: heldout.jsonl
    # (measurements) and calibration.jsonl (STS fitting), disjoint; code prompts first.
    picks: dict[str, list[str]] = {"heldout": [], "calibration": []}
    for kind in sorted(splits["eval"]):
        prompts = [c["messages"][0]["content"] for c in splits["eval"][kind]]
        step = len(prompts) // (2 * num_eval_prompts)
        if step < 1:
            raise SystemExit(f"only {len(prompts)} held-out {kind} conversations")
        picks["heldout"] += prompts[::step][0 : 2 * num_eval_prompts : 2]
        picks["calibration"] += prompts[::step][1 : 2 * num_eval_prompts : 2]
        stats["eval"][f"{kind}_prompts"] = num_eval_prompts
    for name, prompts in picks.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"turns": [p]}) + "\n" for p in prompts)
    return stats


# -- tokenizer ---------------------------------------------------------------------------------
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
# Qwen3 writes its think markers as ordinary added tokens: they survive skip_special_tokens.
THINK_TOKENS = ("<think>", "</think>")
# Qwen2/Qwen3's pre-tokenizer split: newlines stay whole runs, so the blank line closing the empty
# think block is one piece whether or not text follows it (the template stays prefix-stable).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3-like: <|im_start|>role\n ... <|im_end|>\n. With enable_thinking false the generation prompt
# and every assistant turn carry the empty think block (Qwen3 drops it from assistant turns before
# the last user message, which would make rendering not prefix-stable); with thinking on (or the
# variable unset, Qwen3's default) nothing is added and the model would write its own block.
CHAT_TEMPLATE = (
    "{%- set no_think = enable_thinking is defined and enable_thinking is false -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and no_think -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if no_think -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def read_conversations(path: Path) -> Iterator[list[dict]]:
    with open(path) as f:
        for line in f:
            yield json.loads(line)["messages"]


def build_tokenizer(out: Path, train_jsonl: Path) -> dict:
    """Trains the byte-level BPE on the training split and saves a Hugging Face tokenizer."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (m["content"] for conv in read_conversations(train_jsonl) for m in conv)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(list(THINK_TOKENS))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # Written by hand rather than by save_pretrained, whose tokenizer_class differs between
    # transformers 4 and 5: PreTrainedTokenizerFast over tokenizer.json is read by both.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS + THINK_TOKENS}


# -- target ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Causal-LM pretraining of the target on packed chat-rendered conversations."""

    seq_len: int = 512
    batch_size: int = 8
    steps: int = 1200
    learning_rate: float = 3e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    seed: int = 0
    eval_rows: int = 64
    log_every: int = 50


def target_config(dtype: str):
    from dspark_jax.config import Qwen3Config, RopeConfig

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10_000.0),
        tie_word_embeddings=True,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        dtype=dtype,
    )


def packed_rows(tokenizer, jsonl: Path, seq_len: int, seed: int):
    """The conversations of `jsonl` rendered with the chat template (thinking off, as generation
    prompts are), shuffled, concatenated and cut into rows of seq_len + 1 tokens."""
    import numpy as np

    from dspark_jax.tokenizer import encode_chat

    conversations = list(read_conversations(jsonl))
    order = np.random.default_rng(seed).permutation(len(conversations))
    ids = np.concatenate(
        [
            np.asarray(encode_chat(tokenizer, conversations[i], add_generation_prompt=False))
            for i in order
        ]
    ).astype(np.int32)
    n = (len(ids) - 1) // seq_len
    starts = np.arange(n) * seq_len
    return ids[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def pretrain_target(out: Path, tokenizer_dir: Path, corpus: Path, pre: PretrainConfig) -> dict:
    """Trains the target and writes it (bfloat16) with the tokenizer as a Hugging Face folder."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from dspark_jax.checkpoints.convert import export_to_torch
    from dspark_jax.checkpoints.safetensors_io import save_safetensors
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    train_rows = packed_rows(tokenizer, corpus / "train.jsonl", pre.seq_len, pre.seed)
    eval_rows = packed_rows(tokenizer, corpus / "eval.jsonl", pre.seq_len, pre.seed)[
        : pre.eval_rows
    ]
    print(
        f"target data: {train_rows.size:,} training tokens in {len(train_rows)} rows, "
        f"{pre.steps * pre.batch_size / len(train_rows):.2f} epochs; device {jax.devices()[0]}",
        flush=True,
    )
    cfg = target_config("float32")
    model = Qwen3(cfg, rngs=nnx.Rngs(pre.seed), param_dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        pre.learning_rate,
        int(pre.warmup_ratio * pre.steps),
        pre.steps,
        end_value=pre.learning_rate / 10,
    )
    # Decay the matrices, not the norm scales.
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=pre.weight_decay, mask=decay_mask),
    )
    opt_state = optimizer.init(params)

    def loss_fn(params, rows_bt):
        m = nnx.merge(graphdef, params)
        logits_btv = m.logits(m(rows_bt[:, :-1]).hidden)
        return optax.softmax_cross_entropy_with_integer_labels(logits_btv, rows_bt[:, 1:]).mean()

    @jax.jit
    def eval_loss(params, rows_bt):
        return loss_fn(params, rows_bt)

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, rows_bt):
        loss, grads = jax.value_and_grad(loss_fn)(params, rows_bt)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(pre.seed)
    order = np.empty(0, np.int64)
    log = []
    start = time.perf_counter()
    losses = []
    eval_start = float(eval_loss(params, eval_rows))
    for step in range(1, pre.steps + 1):
        if len(order) < pre.batch_size:
            order = np.concatenate([order, rng.permutation(len(train_rows))])
        batch, order = train_rows[order[: pre.batch_size]], order[pre.batch_size :]
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(batch))
        losses.append(loss)
        if step % pre.log_every == 0 or step == pre.steps:
            mean = float(np.mean(jax.device_get(losses)))
            losses = []
            elapsed = time.perf_counter() - start
            entry = {"step": step, "loss": mean, "lr": float(schedule(step)), "elapsed_s": elapsed}
            log.append(entry)
            print(
                f"target step {step}/{pre.steps} loss {mean:.3f} "
                f"({step * batch.size / elapsed:,.0f} tokens/s)",
                flush=True,
            )
    eval_end = float(eval_loss(params, eval_rows))
    train_s = time.perf_counter() - start
    print(f"target held-out loss {eval_start:.3f} -> {eval_end:.3f} ({train_s:.0f} s)", flush=True)

    # Shipped in bfloat16; the config says so and the loaders compute in it unless told otherwise.
    shipped = target_config("bfloat16")
    model = nnx.merge(graphdef, params)
    tensors = {
        k: np.asarray(jnp.asarray(v, jnp.bfloat16))
        for k, v in export_to_torch(model, "model.").items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(shipped.to_hf(), indent=2) + "\n")
    eos = [shipped.eos_token_id, SPECIAL_TOKENS.index("<|endoftext|>")]
    generation = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    (out / "pretrain_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    return {
        "train_tokens": int(train_rows.size),
        "steps": pre.steps,
        "tokens_seen": pre.steps * pre.batch_size * pre.seq_len,
        "held_out_loss": {"start": eval_start, "end": eval_end},
        "seconds": train_s,
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
    }


def check_transformers_parity(target_dir: Path, corpus: Path, num_tokens: int = 256) -> float:
    """Max |logit difference| between our Qwen3 and transformers' Qwen3ForCausalLM reading the
    written folder, both in float32 on held-out text."""
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    from dspark_jax.checkpoints.convert import DictSource, target_from_torch
    from dspark_jax.checkpoints.safetensors_io import SafetensorsFolder
    from dspark_jax.config import Qwen3Config, read_config_json
    from dspark_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    rows = packed_rows(tokenizer, corpus / "eval.jsonl", num_tokens, seed=1)[:2, :num_tokens]
    cfg = Qwen3Config.from_hf(read_config_json(target_dir)).with_dtype("float32")
    folder = SafetensorsFolder(target_dir)
    tensors = {k: np.asarray(folder.get(k), np.float32) for k in folder.keys()}
    ours = target_from_torch(cfg, DictSource(tensors))
    ours_btv = np.asarray(ours.logits(ours(rows).hidden))
    theirs = Qwen3ForCausalLM.from_pretrained(target_dir).float().eval()
    with torch.no_grad():
        theirs_btv = theirs(torch.from_numpy(rows.astype(np.int64))).logits.numpy()
    return float(np.max(np.abs(ours_btv - theirs_btv)))


# -- drafters ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DraftBudget:
    """What both drafters get: the same data, steps, batch, anchors and learning rate."""

    layers: int = 1
    block_size: int = 7  # the released drafters' block
    markov_rank: int = 64
    num_anchors: int = 64
    batch_size: int = 8
    max_length: int = 512
    seq_lens: tuple[int, ...] = (128, 256, 512)
    steps: int = 400
    learning_rate: float = 3e-3
    target_layer_ids: tuple[int, ...] = (0, 1, 2)


def drafter_train_configs(target_dir: Path, corpus: Path, budget: DraftBudget) -> dict:
    """{"dspark": TrainConfig, "dflash": TrainConfig}: the tiny recipes' shape at this size."""
    from dspark_jax.config import DrafterConfig, Qwen3Config, read_config_json
    from dspark_jax.configs.recipes import DSPARK_RECIPE, dflash_recipe
    from dspark_jax.training.trainer import TrainConfig

    target = Qwen3Config.from_hf(read_config_json(target_dir)).with_dtype("float32")
    recipe = dataclasses.replace(
        DSPARK_RECIPE,
        learning_rate=budget.learning_rate,
        dtype="float32",
        global_batch_size=budget.batch_size,
        num_epochs=1,
        max_length=budget.max_length,
        seed=0,
    )
    dspark = DrafterConfig(
        model=dataclasses.replace(target, num_hidden_layers=budget.layers),
        block_size=budget.block_size,
        mask_token_id=SPECIAL_TOKENS.index("<|mask|>"),
        target_layer_ids=budget.target_layer_ids,
        num_target_layers=target.num_hidden_layers,
        markov_rank=budget.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        num_anchors=budget.num_anchors,
    )
    dflash = dataclasses.replace(
        dspark, markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False
    )
    common = dict(
        target=str(target_dir.absolute()),
        data=(str((corpus / "train.jsonl").absolute()),),
        eval_data=(str((corpus / "eval.jsonl").absolute()),),
        num_steps=budget.steps,
        anchors_per_chunk=min(32, budget.num_anchors),
        seq_lens=budget.seq_lens,
        log_every=50,
        eval_batches=8,
        save_every=max(budget.steps // 2, 1),
        keep_checkpoints=1,
    )
    return {
        "dspark": TrainConfig(name="default-dspark", drafter=dspark, recipe=recipe, **common),
        "dflash": TrainConfig(
            name="default-dflash", drafter=dflash, recipe=dflash_recipe(recipe), **common
        ),
    }


# -- drafters, phase 2: the target's own answers ------------------------------------------------
# A drafter is accepted when it predicts what the target writes, not what the corpus says; this
# target is weak (held-out loss 3.6), so the two differ a lot, and drafters trained on the corpus
# alone accept little at T = 0 (first-position acceptance about 0.2-0.3). As upstream does with
# regenerated responses, the drafters are fine-tuned on the target's greedy answers to training
# prompts.
@dataclasses.dataclass(frozen=True)
class DistillBudget:
    prompts: int = 768
    new_tokens: int = 192
    slots: int = 64
    steps: int = 300
    learning_rate: float = 2e-3


def distill_prompts(corpus: Path, budget: DistillBudget) -> Path:
    """A seeded sample of the training split's first user turns (held-out prompts stay out)."""
    import numpy as np

    prompts = [messages[0]["content"] for messages in read_conversations(corpus / "train.jsonl")]
    picked = np.sort(np.random.default_rng(0).choice(len(prompts), budget.prompts, replace=False))
    path = corpus / "distill_prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [prompts[i]]}) + "\n" for i in picked))
    return path


def distill_argv(cli: str, target_dir: Path, corpus: Path, budget: DistillBudget) -> list[str]:
    """`dspark-jax generate`: the target alone, greedy, over the distillation prompts."""
    argv = [cli, "generate", "--target", str(target_dir), "--no-draft", "--temperature", "0"]
    argv += ["--prompts-file", str(corpus / "distill_prompts.jsonl")]
    argv += ["--max-new-tokens", str(budget.new_tokens), "--max-num-seqs", str(budget.slots)]
    return argv + ["--json", str(corpus / "distill_generate.json")]


def distill_corpus(cli: str, target_dir: Path, corpus: Path, budget: DistillBudget) -> dict:
    """corpus/distill.jsonl: each distillation prompt with the target's greedy answer."""
    if not (corpus / "distill_generate.json").exists():
        distill_prompts(corpus, budget)
        argv = distill_argv(cli, target_dir, corpus, budget)
        print("$ " + " ".join(argv), flush=True)
        with open(corpus / "distill.log", "w") as f:
            if subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"failed, see {corpus / 'distill.log'}: {' '.join(argv)}")
    results = json.loads((corpus / "distill_generate.json").read_text())["results"]
    with open(corpus / "distill.jsonl", "w") as f:
        for r in results:
            messages = [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["text"]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    tokens = sum(len(r["tokens"]) for r in results)
    return {"conversations": len(results), "answer_tokens": tokens}


def distilled_configs(configs: dict, out: Path, budget: DistillBudget) -> dict:
    """Phase 2 of each drafter: its phase-1 export fine-tuned on corpus/distill.jsonl."""
    return {
        f"{name}-distilled": dataclasses.replace(
            config,
            name=f"{config.name}-distilled",
            recipe=dataclasses.replace(config.recipe, learning_rate=budget.learning_rate),
            data=(str((out / "corpus" / "distill.jsonl").absolute()),),
            num_steps=budget.steps,
            save_every=max(budget.steps // 2, 1),
            init_drafter=str((out / "runs" / name / "drafter").absolute()),
        )
        for name, config in configs.items()
    }


def config_file_text(config) -> str:
    """A `dspark-jax train --config` file whose CONFIG equals `config` (dataclass reprs are
    valid Python once their classes are imported)."""
    classes = {type(config), type(config.recipe), type(config.drafter), type(config.mesh)}
    classes |= {type(config.drafter.model), type(config.drafter.model.rope)}
    modules: dict[str, list[str]] = {}
    for c in classes:
        modules.setdefault(c.__module__, []).append(c.__name__)
    imports = [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(modules.items())]
    body = pprint.pformat(config, width=100, sort_dicts=False)
    return (
        '"""Written by scripts/build_default_pair.py: one drafter of the default pair."""\n\n'
        + "\n".join(imports)
        + f"\n\nCONFIG = {body}\n"
    )


def cast_folder(src: Path, out: Path, dtype: str = "bfloat16") -> None:
    """Copies a safetensors model folder with its floating tensors and config dtype cast."""
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.checkpoints.convert import is_float_dtype
    from dspark_jax.checkpoints.safetensors_io import SafetensorsFolder, save_safetensors

    folder = SafetensorsFolder(src)
    tensors = {}
    for key in folder.keys():
        array = folder.get(key)
        tensors[key] = (
            np.asarray(jnp.asarray(array, dtype)) if is_float_dtype(array.dtype) else array
        )
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# -- the program -------------------------------------------------------------------------------
def train_drafters(
    cli: str, out: Path, configs: dict, jobs: int, summary: dict, save_summary
) -> None:
    """Trains the drafters whose exported folder is missing, `jobs` `dspark-jax train` processes
    at a time (each logs to train-<name>.log), then casts each export for shipping."""
    todo = [n for n in configs if not (out / "drafters" / n / "model.safetensors").exists()]
    for name in configs:
        if name not in todo:
            print(f"[drafter-{name}] done already", flush=True)
    running: dict[str, tuple[subprocess.Popen, float, list[str]]] = {}
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            config_path = out / "configs" / f"{name}.py"
            config_path.parent.mkdir(parents=True, exist_ok=True)
            config_path.write_text(config_file_text(configs[name]))
            argv = [cli, "train", "--config", str(config_path)]
            argv += ["--output", str(out / "runs" / name), "--no-progress"]
            log = out / f"train-{name}.log"
            print(f"[drafter-{name}] $ {' '.join(argv)}  (log: {log})", flush=True)
            with open(log, "w") as f:
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
            running[name] = (proc, time.perf_counter(), argv)
        time.sleep(2)
        for name, (proc, start, argv) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if proc.returncode:
                raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}), see its log")
            seconds = time.perf_counter() - start
            run_dir = out / "runs" / name
            cast_folder(run_dir / "drafter", out / "drafters" / name)
            end = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            print(f"[drafter-{name}] {seconds:.0f} s, held-out tau {end['tau']:.3f}", flush=True)
            summary["seconds"][f"drafter-{name}"] = seconds
            summary[f"drafter-{name}"] = {
                "command": " ".join(argv[1:]),
                "parallel_jobs": jobs,
                "eval_end": end,
            }
            save_summary()


# -- presets -------------------------------------------------------------------------------------
# "full" is the recipe of the shipped pair (dspark_jax/assets/default/build.json): about 45
# minutes on a quiet 2-core CPU (its README has the measurement), minutes on a GPU. "quick" is the
# same pipeline at a quarter of the target's tokens and shorter drafter phases with half the
# anchors, about 15 minutes on that CPU: for trying the pipeline, not for shipping (its target
# is much weaker, see the README).
PRESETS: dict[str, dict[str, dict]] = {
    "full": {"target": {}, "draft": {}, "distill": {}},
    "quick": {
        "target": {"steps": 300},
        "draft": {"steps": 100, "num_anchors": 32},
        "distill": {"prompts": 512, "steps": 200},
    },
}


def preset_budgets(
    name: str, target_steps: int | None = None, draft_steps: int | None = None
) -> tuple[PretrainConfig, DraftBudget, DistillBudget]:
    """The three budgets of preset `name`, with explicit step counts taking precedence."""
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    pre = dataclasses.replace(PretrainConfig(), **preset["target"])
    draft = dataclasses.replace(DraftBudget(), **preset["draft"])
    distill = dataclasses.replace(DistillBudget(), **preset["distill"])
    if target_steps is not None:
        pre = dataclasses.replace(pre, steps=target_steps)
    if draft_steps is not None:
        draft = dataclasses.replace(draft, steps=draft_steps)
    return pre, draft, distill


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.cli.argtypes import positive_int  # --jobs 0 would wait forever

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/default-pair"))
    parser.add_argument("--docs", type=Path, default=DOCS_HTML, help="python3-doc HTML folder")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts per kind")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="full",
        help="full: the shipped pair's recipe (the default; about 45 minutes on a quiet 2-core "
        "CPU, minutes on a GPU); quick: a weaker pair in about 15 minutes of that CPU",
    )
    parser.add_argument("--target-steps", type=int, help="override the preset's target steps")
    parser.add_argument("--draft-steps", type=int, help="override the preset's phase-1 steps")
    parser.add_argument(
        "--ship", type=Path, help="copy the finished pair here (dspark_jax/assets/default)"
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="drafters trained at once (2: both together, for a machine whose cores are shared)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out
    corpus, tokenizer_dir, target_dir = out / "corpus", out / "tokenizer", out / "target"
    # Checked before anything is written: a typo must not leave an empty --out behind.
    if not (corpus / "train.jsonl").exists() and not args.docs.is_dir():
        raise SystemExit(MISSING_DOCS.format(docs=args.docs))
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.setdefault("seconds", {})
    pre, budget, distill = preset_budgets(args.preset, args.target_steps, args.draft_steps)
    budgets = {"target": pre, "draft": budget, "distill": distill}
    budgets = json.loads(json.dumps({k: dataclasses.asdict(v) for k, v in budgets.items()}))
    if summary.setdefault("budgets", budgets) != budgets:
        raise SystemExit(
            f"{out} was started with other budgets ({summary['budgets']}); "
            "use another --out or the same preset and steps"
        )
    summary["preset"] = args.preset
    print(f"preset {args.preset}: {budgets}", flush=True)
    dspark_jax_cli = str(Path(sys.executable).with_name("dspark-jax"))

    def stage(name: str, done: Path, fn) -> None:
        if done.exists():
            print(f"[{name}] done already ({done})", flush=True)
            return
        print(f"[{name}]", flush=True)
        start = time.perf_counter()
        result = fn()
        summary["seconds"][name] = time.perf_counter() - start
        if result is not None:
            summary[name] = result
        save_summary()

    def save_summary() -> None:
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    stage(
        "corpus",
        corpus / "train.jsonl",
        lambda: build_corpus(corpus, args.docs, args.eval_prompts),
    )
    stage(
        "tokenizer",
        tokenizer_dir / "tokenizer.json",
        lambda: build_tokenizer(tokenizer_dir, corpus / "train.jsonl"),
    )
    stage(
        "target",
        target_dir / "model.safetensors",
        lambda: pretrain_target(target_dir, tokenizer_dir, corpus, pre),
    )
    stage(
        "parity",
        out / "parity.json",
        lambda: _write_parity(out / "parity.json", target_dir, corpus),
    )

    configs = drafter_train_configs(target_dir, corpus, budget)
    train_drafters(dspark_jax_cli, out, configs, args.jobs, summary, save_summary)
    stage(
        "distill",
        corpus / "distill.jsonl",
        lambda: distill_corpus(dspark_jax_cli, target_dir, corpus, distill),
    )
    configs = distilled_configs(configs, out, distill)
    train_drafters(dspark_jax_cli, out, configs, args.jobs, summary, save_summary)

    sizes = {
        "target": folder_bytes(target_dir),
        **{f"drafter-{n}": folder_bytes(out / "drafters" / n) for n in configs},
    }
    summary["bytes"] = sizes
    save_summary()
    # Wall time of this invocation (the drafters of a phase train side by side with --jobs 2,
    # so the stage times overlap and do not add up to it; a resumed run counts what it ran).
    summary["wall_seconds"] = time.perf_counter() - started
    save_summary()
    print(f"sizes (bytes): {sizes}")
    stages = {k: round(v) for k, v in summary["seconds"].items()}
    print(f"stage seconds: {stages}; wall {summary['wall_seconds'] / 60:.1f} min")
    print(f"target: {target_dir}  drafters: {out / 'drafters'}")
    if args.ship is not None:
        ship(args.ship, target_dir, out / "drafters" / SHIPPED_DRAFTER, summary)
        print(f"shipped the target and the {SHIPPED_DRAFTER} drafter to {args.ship}")
    return 0


# The drafter that ships as the default; the DFlash one is trained for the comparison only.
SHIPPED_DRAFTER = "dspark-distilled"
TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def ship(dest: Path, target_dir: Path, drafter_dir: Path, summary: dict) -> None:
    """Copies the files a decoding run reads into `dest` (target/, draft/) and the build's
    summary as build.json; the package's assets/default/ is made this way."""
    import shutil

    for sub, folder, names in (
        ("target", target_dir, TARGET_FILES),
        ("draft", drafter_dir, ("config.json", "model.safetensors")),
    ):
        (dest / sub).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(folder / name, dest / sub / name)
    (dest / "build.json").write_text(json.dumps(summary, indent=2) + "\n")


def _write_parity(path: Path, target_dir: Path, corpus: Path) -> dict:
    max_diff = check_transformers_parity(target_dir, corpus)
    print(f"max |logits(ours) - logits(transformers)| = {max_diff:.2e}", flush=True)
    if not max_diff < 1e-3:
        raise SystemExit(f"transformers parity failed: max logit difference {max_diff}")
    result = {"max_abs_logit_diff": max_diff}
    path.write_text(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
