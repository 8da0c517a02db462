"""Time of each paged-attention path against the kv length in use and against the pool size.

    PYTHONPATH=. python benchmarks/attention_paths.py --json attention_paths.json

A verification-shaped step: `--slots` sequences of `--q-len` query tokens each (causal, the
new tokens already written), every sequence holding `kv_len` keys. Two sweeps:

- kv sweep: kv_len doubles while the pool and the page table stay fixed (room for
  `--capacity` positions per slot). A path whose cost follows the keys in use roughly doubles.
- pool sweep: kv_len stays at `--fixed-kv` while the per-slot capacity (so pages_per_slot and
  num_pages) doubles. A path whose cost follows the keys in use stays flat; the dense
  reference, which reads every page of the table, grows.
- mixed sweep: one sequence holds the kv sweep's kv_len and every other `--short-kv` keys. A
  path whose cost follows the keys in use (the `keys` column) grows with the one long
  sequence only; one that walks every sequence to the longest context grows like the kv sweep.

Paths: "dense" and "jax" everywhere, plus the backend's kernel path ("pallas_gpu" /
"pallas_tpu") on an accelerator. Interpret-mode kernels are not timed: that measures the
interpreter. A cell is the median over --repeats calls of one compiled program; calls
alternate between cells so that load from elsewhere on the machine hits every cell alike.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from provenance import (
    Parser,
    git_commit,
    measured,
    output_file,
    positive_int,
    positive_ints,
    run_main,
    write_json,
)

from dspark_jax.errors import UserError
from dspark_jax.models import attention as attn

DTYPES = ("float32", "bfloat16", "float16")
# The kernel paths and the backend each compiles for; anywhere else they would run in interpret
# mode, which times the interpreter (see the module docstring).
KERNEL_BACKENDS = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def build(impl, *, slots, q_len, kv_len, capacity, page_size, kv_heads, groups, head_dim, dtype,
          short_kv=None, seed=0):
    """Pages filled for `slots` sequences of kv_len keys (with `short_kv`: the first one only,
    the others short_kv) and the packed query batch."""
    pages_per_slot = capacity // page_size
    layout = attn.PagedLayout(slots * pages_per_slot, page_size, kv_heads, head_dim, impl)
    rng = np.random.default_rng(seed)
    table = rng.permutation(slots * pages_per_slot).reshape(slots, pages_per_slot)
    table = jnp.asarray(table, jnp.int32)
    kv_lens = np.full(slots, kv_len if short_kv is None else short_kv, np.int32)
    kv_lens[0] = kv_len
    tokens = int(kv_lens.sum())
    slot_t = jnp.asarray(np.repeat(np.arange(slots, dtype=np.int32), kv_lens))
    pos_t = jnp.asarray(np.concatenate([np.arange(n, dtype=np.int32) for n in kv_lens]))
    k = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    pages = jax.jit(attn.write_kv, static_argnums=1)(
        attn.init_pages(layout, dtype), layout, attn.stack_kv(k, v), table, slot_t, pos_t,
        jnp.ones((tokens,), bool))
    q = jnp.asarray(rng.standard_normal((slots * q_len, kv_heads * groups, head_dim)), dtype)
    meta = (
        table,
        jnp.arange(slots, dtype=jnp.int32),
        jnp.arange(slots + 1, dtype=jnp.int32) * q_len,
        jnp.asarray(kv_lens),
        jnp.int32(slots),
    )
    return layout, pages, q, meta


def time_paths(configs, repeats) -> list[float]:
    """Median ms per config. Calls go round-robin over the configs, so load from other work on
    the machine drifts into every cell alike instead of into whichever sweep ran during it."""
    runs = []
    for impl, shape in configs:
        layout, pages, q, meta = build(impl, **shape)
        step = jax.jit(attn.ragged_paged_attention, static_argnums=2,
                       static_argnames=("scale", "causal"))
        call = functools.partial(step, q, pages, layout, *meta, scale=shape["head_dim"] ** -0.5,
                                 causal=True)
        call().block_until_ready()
        runs.append(call)
    times = [[] for _ in configs]
    for _ in range(repeats):
        for call, cell in zip(runs, times, strict=True):
            start = time.perf_counter()
            call().block_until_ready()
            cell.append(time.perf_counter() - start)
    return [statistics.median(cell) * 1e3 for cell in times]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the shapes checked: every kv length fits the capacity it is
    timed at, capacities are whole pages, and the kernel paths asked for run on this backend."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--q-len", type=positive_int, default=4)
    parser.add_argument("--kv-heads", type=positive_int, default=4)
    parser.add_argument("--groups", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--kv-lens", type=positive_ints, default=(128, 256, 512, 1024),
                        help="kv sweep: keys per sequence (each at most --capacity)")
    parser.add_argument("--capacity", type=positive_int, default=2048,
                        help="kv sweep: positions per slot, a multiple of --page-size")
    parser.add_argument("--fixed-kv", type=positive_int, default=256,
                        help="pool sweep: keys per sequence (at most every --capacities)")
    parser.add_argument("--capacities", type=positive_ints, default=(512, 1024, 2048, 4096),
                        help="pool sweep: positions per slot, multiples of --page-size")
    parser.add_argument("--short-kv", type=positive_int, default=64,
                        help="mixed sweep: keys of every sequence but the long one")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated, of {', '.join(attn.IMPLS)}; default dense, jax "
                        "and the backend's kernel path (a kernel path runs on its own backend "
                        "only)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    page = args.page_size
    for option, sizes in (("--capacity", (args.capacity,)), ("--capacities", args.capacities)):
        odd = [c for c in sizes if c % page]
        if odd:
            parser.error(f"{option} {','.join(map(str, odd))}: not a multiple of --page-size "
                         f"{page}")
    too_long = [n for n in args.kv_lens if n > args.capacity]
    if too_long:
        parser.error(f"--kv-lens {','.join(map(str, too_long))}: more keys than --capacity "
                     f"{args.capacity} positions hold")
    if args.fixed_kv > min(args.capacities):
        parser.error(f"--fixed-kv {args.fixed_kv}: more keys than --capacities "
                     f"{min(args.capacities)} positions hold")
    if args.short_kv > args.capacity:
        parser.error(f"--short-kv {args.short_kv}: more keys than --capacity {args.capacity} "
                     "positions hold")
    short = [n for n in (*args.kv_lens, args.fixed_kv, args.short_kv) if n < args.q_len]
    if short:
        parser.error(f"kv lengths {','.join(map(str, short))}: fewer keys than the --q-len "
                     f"{args.q_len} new tokens they include")
    if args.impls is not None:
        args.impls = args.impls.split(",")
        unknown = [i for i in args.impls if i not in attn.IMPLS]
        if unknown:
            parser.error(f"--impls {','.join(unknown)}: not one of {', '.join(attn.IMPLS)}")
    return args


def check_backend(impls) -> None:
    """Refuses a kernel path that would not run on the backend here (UserError)."""
    backend = jax.default_backend()
    for impl in impls:
        needs = KERNEL_BACKENDS.get(impl)
        if needs is not None and needs != backend:
            raise UserError(f"--impls {impl}: runs on {needs} only; this backend is {backend} "
                            "(interpret mode would time the interpreter)")


def main():
    args = parse_args()
    if args.json:
        output_file(args.json, "--json")
    impls = args.impls or ["dense", "jax"]
    if args.impls is None and attn.default_impl() != "jax":
        impls.append(attn.default_impl())
    check_backend(impls)
    common = dict(slots=args.slots, q_len=args.q_len, page_size=args.page_size,
                  kv_heads=args.kv_heads, groups=args.groups, head_dim=args.head_dim,
                  dtype=jnp.dtype(args.dtype))
    rows = []
    for impl in impls:
        for kv_len in args.kv_lens:
            rows.append(dict(sweep="kv", impl=impl, kv_len=kv_len, capacity=args.capacity))
        for capacity in args.capacities:
            rows.append(dict(sweep="pool", impl=impl, kv_len=args.fixed_kv, capacity=capacity))
        for kv_len in args.kv_lens:
            rows.append(dict(sweep="mixed", impl=impl, kv_len=kv_len, capacity=args.capacity,
                             short_kv=args.short_kv))
    configs = [(row["impl"], dict(kv_len=row["kv_len"], capacity=row["capacity"],
                                  short_kv=row.get("short_kv"), **common))
               for row in rows]
    for row, ms in zip(rows, time_paths(configs, args.repeats), strict=True):
        row["ms"] = ms

    device = jax.devices()[0]
    print(f"device {device.device_kind} ({jax.default_backend()}), commit {git_commit()}, "
          f"{args.slots} slots x {args.q_len} queries, {args.kv_heads * args.groups}/"
          f"{args.kv_heads} heads, head_dim {args.head_dim}, page {args.page_size}, {args.dtype}")
    print(f"{'sweep':<6}{'impl':<12}{'kv_len':>8}{'keys':>8}{'capacity':>10}{'pages':>8}"
          f"{'ms':>10}{'x first':>9}")
    first = {}
    for row in rows:
        base = first.setdefault((row["sweep"], row["impl"]), row["ms"])
        row["num_pages"] = args.slots * row["capacity"] // args.page_size
        row["keys"] = row["kv_len"] + (args.slots - 1) * row.get("short_kv", row["kv_len"])
        row["ratio_to_first"] = row["ms"] / base
        print(f"{row['sweep']:<6}{row['impl']:<12}{row['kv_len']:>8}{row['keys']:>8}"
              f"{row['capacity']:>10}{row['num_pages']:>8}{row['ms']:>10.2f}"
              f"{row['ratio_to_first']:>9.2f}")
    if args.json:
        write_json(args.json, dict(
            benchmark="attention_paths",
            **measured(),
            backend=jax.default_backend(),
            settings={k: (str(v) if k == "dtype" else v) for k, v in vars(args).items()
                      if k != "json"},
            rows=rows,
        ), indent=2)


if __name__ == "__main__":
    run_main(main)
