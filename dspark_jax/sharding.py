"""Device meshes, the logical-axis rules table, and sharding of NNX states.

Every parameter carries `logical_axes` metadata (one name per dimension, see
`dspark_jax.models.layers`); activations are named at the call sites that constrain them. One
rules table, `LOGICAL_RULES`, maps each logical name to mesh axes of the (data, fsdp, tensor)
mesh:

- data:   pure data parallelism (parameters replicated, batch split);
- fsdp:   batch split too, and parameters sharded along their `embed`-like dimension (ZeRO-3;
          XLA gathers them where a matmul needs them);
- tensor: Megatron-style splitting of heads, MLP width and vocabulary.

A mesh axis is used at most once per array (the first dimension that claims it wins). Training
splits a dimension only when its size divides evenly by the mesh axes it maps to, so every rule is
safe on every mesh shape; inference asks for `strict` specs instead, where a dimension that does
not divide is an error naming it (a silently replicated 8B target would not fit its devices).
Nothing assumes a device count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dspark_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# logical name -> mesh axes. Parameter names come from the models; activation names from the
# train step (`batch`, `length`, `features`, `block`); cache and slot names from the decoding
# engine (`slots`, `pages`; a page pool's heads are `kv_heads`).
LOGICAL_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("block", None),
    ("features", None),
    # decoding state: a slot row is one request, split like a batch row. The pool's page axis
    # stays whole: any slot may own any page, so splitting pages over `data` would turn every
    # page-table gather into a cross-device one (see docs/engine.md, "On a mesh").
    ("slots", ("data", "fsdp")),
    ("pages", None),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("context", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("markov", None),
    # The confidence head's input, [hidden; Markov rank]: its kernel is one column, and split
    # along fsdp it split the Markov part's gradient on its way into the (batch-split) table
    # lookup, which XLA could do only by replicating it.
    ("head_in", None),
    ("head_dim", None),
    ("norm", None),
    ("scalar", None),
)


class ShardingError(UserError):
    """A mesh that does not fit the devices, or a logical axis the rules do not know."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; at most one may be -1, meaning "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if any(s == 0 or s < -1 for s in sizes):
            raise ShardingError(f"mesh axis sizes must be positive or -1, got {sizes}")
        if sizes.count(-1) > 1:
            raise ShardingError(f"at most one mesh axis may be -1, got {sizes}")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """The (data, fsdp, tensor) sizes for `num_devices` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        named = dict(zip(MESH_AXES, sizes, strict=True))
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ShardingError(
                    f"{num_devices} devices cannot be split into a mesh with fixed axes "
                    f"{named} (product {fixed} does not divide it)"
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        elif fixed != num_devices:
            raise ShardingError(
                f"mesh {named} has {fixed} devices but {num_devices} "
                "are present; use -1 for one axis to absorb the rest"
            )
        return tuple(sizes)


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.shape(len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES,
    *,
    strict: bool = False,
    what: str | None = None,
) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have `logical_axes`.

    `None` names an unsharded dimension. A dimension keeps only the mesh axes not already used by
    an earlier dimension, and none at all when its size does not divide evenly by them -- or,
    with `strict`, a ShardingError that names the dimension, its size and the mesh axes (after
    `what`, the model or array they belong to, where given).
    """
    if len(logical_axes) != len(shape):
        raise ShardingError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ShardingError(
                f"logical axis {name!r} has no rule; known: {', '.join(sorted(table))}"
            )
        target = table[name]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        if axes and size % math.prod(mesh.shape[a] for a in axes):
            if strict:
                split = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
                raise ShardingError(
                    f"{what + ': ' if what else ''}logical axis {name!r} of size {size} does not "
                    f"divide the mesh axes it maps to ({split}); give a --mesh (mesh=) whose "
                    f"{' x '.join(axes)} size divides {size}"
                )
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES,
    *,
    strict: bool = False,
    what: str | None = None,
) -> NamedSharding:
    """`logical_to_spec` as a NamedSharding on `mesh`."""
    spec = logical_to_spec(logical_axes, shape, mesh, rules, strict=strict, what=what)
    return NamedSharding(mesh, spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(
    tree,
    mesh: Mesh,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES,
    *,
    strict: bool = False,
    what: str | None = None,
):
    """NamedShardings for a pytree of NNX Variables and arrays, with the same structure.

    Variables with `logical_axes` metadata (parameters, and optimizer moments, which optax builds
    as copies of them) get their rule-based sharding inside a Variable of the same type, so the
    result matches `tree` as a jit in/out sharding or a `device_put` target; everything else
    (step counters, PRNG keys, scalars) is replicated. `tree` may be abstract (`nnx.eval_shape`).
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if _is_variable(x):
            axes = x.get_metadata().get("logical_axes")
            shape = x.shape
            sharding = (
                replicated
                if axes is None
                else logical_sharding(axes, shape, mesh, rules, strict=strict, what=what)
            )
            return x.replace(sharding)
        return replicated

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def shard_state(tree, mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES):
    """`tree` placed on `mesh` with `state_shardings`."""
    return jax.device_put(tree, state_shardings(tree, mesh, rules))


def constrain(
    x: jax.Array,
    logical_axes: Sequence[str | None],
    mesh: Mesh | None,
    rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES,
) -> jax.Array:
    """Sharding constraint on an activation inside jit (identity without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, x.shape, mesh, rules))


def addressable_rows(sharding: jax.sharding.Sharding, size: int) -> tuple[int, ...]:
    """The indices along dimension 0 (of `size`) that this process's devices hold under `sharding`,
    ascending: the rows of a global batch this process must supply."""
    rows = set()
    for index in sharding.addressable_devices_indices_map((size,)).values():
        rows.update(range(*index[0].indices(size)))
    return tuple(sorted(rows))


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto_detect: bool = False,
) -> bool:
    """Starts `jax.distributed` for multi-host runs; returns whether it is (now) initialized.

    With no arguments and `auto_detect` False this is a no-op, so single-process runs never touch
    the coordination service. `auto_detect` lets JAX find the cluster itself (TPU pods, SLURM,
    Open MPI). Must run before anything queries devices.

    CPU processes need a cross-process collective implementation: gloo (over TCP, any machine) is
    chosen unless one is set (recent jax defaults to it; jax 0.6 defaulted to none).
    """
    if jax.distributed.is_initialized():
        return True
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ShardingError(
            "give coordinator_address, num_processes and process_id together (or none of them "
            "with auto_detect=True)"
        )
    if all(v is None for v in explicit) and not auto_detect:
        return False
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def tensor_split_sizes(model_cfg) -> dict[str, int]:
    """The sizes of a Qwen3Config (a target, or a drafter's `model`) that the `tensor` axis
    splits: whole heads (see `check_model_split`), the vocabulary and the MLP width."""
    return {
        "attention heads": model_cfg.num_attention_heads,
        "key/value heads": model_cfg.num_key_value_heads,
        "vocabulary entries (vocab_size)": model_cfg.vocab_size,
        "MLP width (intermediate_size)": model_cfg.intermediate_size,
    }


def models_split_sizes(*model_cfgs) -> list[int]:
    """`tensor_split_sizes` of several Qwen3Configs (a target, a drafter's `model`), in one list:
    every size a mesh's tensor axis must divide to split them all."""
    return [size for cfg in model_cfgs for size in tensor_split_sizes(cfg).values()]


def tensor_sizes_that_fit(sizes, limit: int) -> list[int]:
    """The tensor sizes up to `limit` that divide every one of `sizes`, ascending."""
    common = math.gcd(*sizes) if sizes else 1
    return [t for t in range(1, limit + 1) if common % t == 0]


def check_model_split(what: str, model_cfg, mesh: Mesh) -> None:
    """Raises ShardingError unless the `tensor` axis divides every size it splits in the model
    `what` names (`tensor_split_sizes`), before anything is allocated.

    Projection kernels store heads flattened with head_dim ([embed, heads * head_dim]), so a
    divisible flat size can still cut a head in two; attention needs whole heads per device.
    """
    tensor = mesh.shape["tensor"]
    sizes = tensor_split_sizes(model_cfg)
    for name, count in sizes.items():
        if count % tensor:
            fits = tensor_sizes_that_fit(list(sizes.values()), mesh.devices.size)
            raise ShardingError(
                f"{what}: the mesh's tensor size {tensor} does not divide its {count} {name}; "
                f"give a --mesh whose tensor size divides it (for this model: "
                f"{', '.join(map(str, fits))})"
            )


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` without replication checks (its body may hold Pallas calls and loops).

    JAX 0.10 and 0.11 both export `jax.shard_map`; older releases only the experimental one.
    """
    public = getattr(jax, "shard_map", None)
    if public is not None:
        return public(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return experimental(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def device_memory_bytes(device=None) -> int | None:
    """The memory one device offers to arrays, or None where the backend does not say (CPU)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("bytes_limit")


# Share of one device's memory the parameters may take before the default decoding mesh spreads
# them over the tensor axis: the rest holds the KV page pools and the activations.
PARAMS_SHARE_OF_DEVICE = 0.75


def decoding_mesh(
    config: MeshConfig | None, param_bytes, devices=None, split_sizes=None
) -> Mesh | None:
    """The mesh the decoding commands run on.

    An explicit `config` is used as given, over `devices` (default all devices); sizes that
    multiply to fewer devices (no -1) take the first that many, the rest idle -- unlike
    training's `make_mesh`, which wants them all: a decoding mesh gains nothing from data
    replicas, so `--mesh 1,1,2` on 8 devices is a sensible request. Without one:
    no mesh (one device) while the parameters take at most `PARAMS_SHARE_OF_DEVICE` of one
    device's memory, else the first T local devices on the `tensor` axis, T the largest number of
    them that divides every size in `split_sizes()` (both models' `tensor_split_sizes`) --
    tensor parallelism splits the weights and the KV heads, the two things that grow with the
    model. Devices past T stay idle: for decoding, data (and fsdp) replicas copy the weights and
    repeat the work (docs/engine.md, "On a mesh"). Where no T above 1 fits, a ShardingError
    says that the automatic choice failed and asks for a --mesh. `param_bytes()` gives the
    parameters' size; it is only asked where device memory is known.
    """
    if config is not None:
        devices = list(jax.devices() if devices is None else devices)
        sizes = (config.data, config.fsdp, config.tensor)
        if -1 not in sizes and math.prod(sizes) < len(devices):
            devices = devices[: math.prod(sizes)]
        if -1 not in sizes and math.prod(sizes) > len(devices):
            # Not training's advice (-1 to take them all): decoding may use fewer.
            raise ShardingError(
                f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} has {math.prod(sizes)} "
                f"devices but {len(devices)} are present: give sizes that multiply to at most "
                f"{len(devices)} (e.g. --mesh 1,1,{len(devices)}), or -1 for one axis to take "
                "the rest"
            )
        return make_mesh(config, devices)
    local = list(devices if devices is not None else jax.local_devices())
    limit = device_memory_bytes(local[0])
    if limit is None or len(local) == 1:
        return None
    need = param_bytes()
    if need <= PARAMS_SHARE_OF_DEVICE * limit:
        return None
    if split_sizes is None:
        tensor = len(local)
    else:
        tensor = tensor_sizes_that_fit(list(split_sizes()), len(local))[-1]
    if tensor == 1:
        raise ShardingError(
            f"the parameters ({need / 2**30:.2f} GiB) do not fit one device ({limit / 2**30:.2f} "
            f"GiB, {PARAMS_SHARE_OF_DEVICE:.0%} for parameters), and the automatic mesh puts them "
            f"on a tensor axis, but no tensor size from 2 to {len(local)} divides the models' "
            "head counts, vocabulary and MLP width: give --mesh 1,-1,1 (fsdp splits the "
            "weights along their embedding) or a smaller model"
        )
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor), local[:tensor])


def mesh_sizes(shape) -> str:
    """A mesh's sizes as --mesh spells them ("1,1,2"): `shape` is a Mesh's or a record of it
    ({axis: size}; an axis it lacks has size 1)."""
    return ",".join(str(shape.get(a, 1)) for a in MESH_AXES)


def describe_mesh(mesh: Mesh | None) -> str:
    """One line on the mesh in use: its sizes and devices (of how many present)."""
    if mesh is None:
        return "one device (no mesh)"
    sizes = " x ".join(f"{a} {mesh.shape[a]}" for a in MESH_AXES)
    return f"mesh {sizes} ({mesh.devices.size} of {jax.device_count()} devices)"


def put_host_array(array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array of `sharding` from a host array that every process can read in full.

    Each addressable device receives only its own slice, so a weight never sits whole on one
    device, and on a pod slice every process fills just its local devices.
    """
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def host_value(x: jax.Array):
    """The whole value of `x` on this host, gathered across processes when it spans several."""
    if getattr(x, "is_fully_addressable", True):
        return jax.device_get(x)
    from jax.experimental.multihost_utils import process_allgather

    return process_allgather(x, tiled=True)


def init_sharded(make_module, mesh: Mesh | None, what: str | None = None):
    """`make_module()` (an NNX module with random weights) built directly in its rules-table
    shardings on `mesh`: each device computes only its own slices (one device: plain call)."""
    if mesh is None:
        return make_module()
    graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract, mesh, strict=True, what=what)
    state = jax.jit(lambda: nnx.split(make_module())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)
