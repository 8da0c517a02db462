"""Measured device memory bandwidth: the ceiling the decode floor divides by.

A large device-to-device copy, timed after a warm-up, median of repeats, counting bytes read
plus bytes written: a jitted `x * 1.0000001` of a float32 buffer, one read and one write per
element (`x + 0` or `x * 1` would be simplified away, returning the input unread). A datasheet
gives the peak (NVIDIA's figure for an H100 SXM is 3.35 TB/s), which a copy does not reach, so
decode_speed.py's floor uses this measurement where it has one (--bandwidth-json).

    python benchmarks/bandwidth.py [--gib 4] [--json bandwidth.json]
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from provenance import Parser, output_file, positive_float, positive_int, run_main, write_json


def measure_gbs(gib: float = 4.0, repeats: int = 20) -> float:
    """GB/s (1e9 bytes) of read + write for a copy of `gib` GiB of float32."""
    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0000001)  # one read and one write per element, not elided
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - start)
    return 2 * n * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gib", type=positive_float, default=4.0, help="buffer size (default 4 GiB)"
    )
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed copies (20)")
    parser.add_argument("--json", help="write {device, gbs} here")
    args = parser.parse_args()
    if args.json:  # checked before measuring: a typo in the folder fails now, not after
        output_file(args.json, "--json")
    if int(args.gib * 2**30) // 4 < 1:
        parser.error(f"--gib {args.gib}: smaller than one float32")
    device = jax.devices()[0]
    gbs = measure_gbs(args.gib, args.repeats)
    print(f"{device.device_kind}: {gbs:.0f} GB/s (read + write, {args.gib} GiB float32 copy)")
    if args.json:
        write_json(args.json, {"device": device.device_kind, "gbs": gbs}, indent=None)


if __name__ == "__main__":
    run_main(main)
