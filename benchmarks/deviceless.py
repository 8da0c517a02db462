"""Compiling for a GPU that is not here: XLA's own GPU compiler, run on this machine's CPU.

`jax.experimental.topologies` builds stand-in devices of a GPU from a description of it (the
`GpuTargetConfigProto` text below); programs whose arguments are placed on those devices are
lowered and compiled by the real XLA:GPU pipeline (fusion, scheduling, buffer assignment,
Triton and PTX generation, ptxas) without a GPU. What comes back can be inspected, not run:
compile time, the optimised HLO, `memory_analysis()`, and what ptxas said of each kernel. It
needs JAX's CUDA plugin and the CUDA compiler wheels (`pip install "jax[cuda12]"`, about 5 GB),
not a GPU or a driver. Used by lowering_time.py (`--platform h100`), mesh_memory.py (`--gpu`)
and train_step_cost.py (`--gpu`).

A module the scripts import, not a script: running it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from dspark_jax.errors import UserError

# The GPUs' published figures (NVIDIA's H100 and H200 SXM datasheets: SMs, clocks, memory and
# bandwidth, L2) and CUDA's per-SM limits for compute capability 9.0, which XLA reads to choose
# fusions, tile sizes and launch dimensions. CUDA 12.8 and cuDNN 9.8 name the toolkit the
# programs are compiled for (the GPU machine's own may differ; that changes no layout). The
# device's driver, runtime and toolkit versions are what a GPU reports to XLA: without them XLA
# takes the driver for older than CUDA 12.3 and keeps every conditional out of the CUDA graphs
# it builds (its command buffers), where on a real GPU a conditional whose branches hold only
# kernels runs inside the graph, without the host reading its predicate back.
_HOPPER = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
  driver_version: "12.8.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{kind}"
"""
# Memory as the CUDA runtime reports it (nvidia-smi: 81559 and 143771 MiB).
_MEMORY = {"h100": 81_559 * 2**20, "h200": 143_771 * 2**20}
GPU_MEMORY_GB = {name: size / 1e9 for name, size in _MEMORY.items()}
GPUS = {
    "h100": _HOPPER.format(
        kind="NVIDIA H100 80GB HBM3", memory=_MEMORY["h100"], bandwidth=3_352_320_000_000
    ),
    "h200": _HOPPER.format(kind="NVIDIA H200", memory=_MEMORY["h200"], bandwidth=4_800_000_000_000),
}

# ptxas, when a kernel needs more registers than it may have: the rest live in local memory.
_SPILL = re.compile(
    r"Registers are spilled to local memory in function '([^']+)', "
    r"(\d+) bytes spill stores, (\d+) bytes spill loads"
)

_INFO = re.compile(r"I\d{4} ")  # absl's informational lines: I<month><day> <time> ...


def prepare_logging() -> None:
    """Lets XLA's informational messages through (ptxas' register-spill warnings are among
    them). Call before JAX is imported: its C++ logging reads the level once."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")


def gpu_devices(name: str) -> list:
    """The stand-in devices of one `name` GPU (a key of GPUS). JAX must not have started a
    backend yet: this process is switched to the CPU platform, the GPU is only compiled for."""
    import jax
    from jax.experimental import topologies

    if name not in GPUS:
        raise UserError(f"no GPU named {name!r}: {', '.join(sorted(GPUS))}")
    jax.config.update("jax_platforms", "cpu")
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=GPUS[name], topology="1x1x1"
        )
    except Exception as err:  # the plugin is missing, or too old for deviceless compiling
        raise UserError(
            f"cannot compile for a GPU without one here ({type(err).__name__}: {err}); this "
            'needs JAX\'s CUDA plugin and compiler wheels: pip install "jax[cuda12]"'
        ) from err
    return list(topology.devices)


@dataclass
class Spills:
    """Kernels ptxas had to spill registers for, while compiling in a `captured_spills` block:
    function name -> (bytes stored, bytes loaded), the largest of its variants."""

    kernels: dict[str, tuple[int, int]] = field(default_factory=dict)


@contextlib.contextmanager
def captured_spills() -> Iterator[Spills]:
    """Reads what XLA writes to the process' stderr (file descriptor 2, where its C++ logging
    goes) while the block runs and keeps ptxas' register-spill warnings; the other messages
    but the informational ones (which `prepare_logging` lets through for the spills' sake) are
    written back to stderr afterwards. Kernel names lose their `__<n>` variant suffixes."""
    spills = Spills()
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield spills
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text = log.read().decode(errors="replace")
            for line in text.splitlines():
                match = _SPILL.search(line)
                if match is None:
                    if line.strip() and not _INFO.match(line):
                        os.write(2, (line + "\n").encode())
                    continue
                name = re.sub(r"__\d+$", "", match.group(1))
                stored, loaded = int(match.group(2)), int(match.group(3))
                old = spills.kernels.get(name, (0, 0))
                spills.kernels[name] = (max(old[0], stored), max(old[1], loaded))
