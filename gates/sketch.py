"""Gradient sketches and bit fingerprints: compact, faithful summaries of a run's tensors (docs/records.md).

A record cannot hold a large model's gradients, so it holds, per parameter tensor:

- a **CountSketch** of width ``w`` (a sparse Johnson-Lindenstrauss map): element ``x[i]`` is added with sign
  ``s(i) = +-1`` to bucket ``b(i) in [0, w)``, both hashed from (seed, the tensor's path, the element's *global*
  index). The map is linear, so ``S(a) - S(b) = S(a - b)`` and ``||S(a) - S(b)||`` estimates ``||a - b||``
  (unbiased for the square; the relative error of the norm is about ``1 / sqrt(2 w)`` for spread-out differences,
  measured in ``benchmarks/sketch_error.py``). A tensor with ``numel < w`` is kept exactly (flattened, float32).
- a **bit fingerprint**: two independent uint32 lanes, each the wrapping sum over elements of a hash of (the element's
  global index, its bit pattern). A sum does not depend on the order or on how the tensor is split over devices, so
  the shards' partial fingerprints are combined with one psum. Equal tensors have equal fingerprints; a tensor that
  differs in any bit changes each lane with probability ``1 - 2**-32`` (not a cryptographic hash).

The hashes are uint32 integer mixing (the murmur3 32-bit finalizer) in ``jax.numpy``, so both summaries are jit-able and
run in one pass over the tensor. The element's global index enters per dimension (``h = mix(h + (i_d + offset_d) * G)``
over the dimensions ``d``), so a shard needs only its offsets; no tensor is gathered:

- under ``jax.jit`` with sharded inputs, ``sketch``/``fingerprint`` are a per-element map and a scatter-add (or a sum)
  into a replicated ``[w]``: the partitioner computes each shard's partial result and adds them with one all-reduce;
- inside ``shard_map``, ``sketch_shard``/``fingerprint_shard`` take the local block and its offsets (e.g.
  ``jax.lax.axis_index(axis) * local_size``); ``jax.lax.psum`` the result over the mesh axes the tensor is split on.

Either way the sketch equals the unsharded one up to the order of the float32 additions (measured in
``tests/gates/test_sketch.py``), and the fingerprint equals it bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SKETCH_KIND = "countsketch-v1"
DEFAULT_WIDTH = 4096  # chosen from the measured error table in docs/records.md
_GOLDEN = 0x9E3779B1  # odd: i -> h + i * G is a bijection mod 2**32
_LANE_KEYS = (0x68E31DA4, 0xB5297A4D)  # the fingerprint's two lanes
_SKETCH_KEY = 0x1B56C4E9


@dataclasses.dataclass(frozen=True)
class SketchSpec:
    """What makes two sketches comparable: the kind (hash functions), the width and the seed."""

    width: int = DEFAULT_WIDTH
    seed: int = 0
    kind: str = SKETCH_KIND

    def __post_init__(self):
        _check_width_seed(self.width, self.seed)
        if self.kind != SKETCH_KIND:
            raise ValueError(f"SketchSpec: kind={self.kind!r} is not known (this version reads {SKETCH_KIND!r})")

    def to_json(self) -> dict:
        return {"kind": self.kind, "width": self.width, "seed": self.seed}

    @classmethod
    def from_json(cls, obj: Any) -> SketchSpec:
        if not isinstance(obj, Mapping) or set(obj) != {"kind", "width", "seed"}:
            raise ValueError(f"SketchSpec.from_json: {obj!r} must be {{'kind', 'width', 'seed'}}")
        return cls(width=obj["width"], seed=obj["seed"], kind=obj["kind"])


def _check_width_seed(width, seed) -> None:
    if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or not 1 <= width <= 2**24:
        raise ValueError(f"sketch: width={width!r} must be an int in [1, 2**24]")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"sketch: seed={seed!r} must be an int in [0, 2**32)")


# ---------------------------------------------------------------------------------------------------------- hashing
def _mix_np(h: int) -> int:
    """The murmur3 32-bit finalizer on a Python int (host side, for the per-tensor keys)."""
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def mix32(h: jax.Array) -> jax.Array:
    """The murmur3 32-bit finalizer on uint32 arrays (a bijection of uint32; multiplications wrap)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def path_hash(path: str) -> int:
    """A uint32 hash of a tensor's path (host side: the first 4 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:4], "little")


def tensor_key(path: str, seed: int, salt: int) -> int:
    """The per-tensor, per-purpose uint32 key all element hashes start from."""
    return _mix_np(_mix_np(seed ^ salt) ^ path_hash(path))


def tensor_keys(path: str, seed: int) -> np.ndarray:
    """uint32 [3]: the keys of the tensor ``path``: its sketch's (with ``seed``), then its fingerprint's two lanes (the
    inputs of ``sketch_keyed`` and ``fingerprint_keyed``)."""
    return np.asarray([tensor_key(path, seed, _SKETCH_KEY), *(tensor_key(path, 0, salt) for salt in _LANE_KEYS)],
                      np.uint32)


def _index_hash(key, local_shape: Sequence[int], offsets: Sequence[Any]) -> jax.Array:
    """uint32 [*local_shape]: a hash of each element's global index (one mixing round per dimension); ``key``: a
    Python int or a traced uint32 scalar (the same arithmetic)."""
    h = jnp.uint32(key) if isinstance(key, int) else jnp.asarray(key, jnp.uint32)
    nd = len(local_shape)
    for d, n in enumerate(local_shape):
        shape = [1] * nd
        shape[d] = int(n)
        idx = jax.lax.broadcasted_iota(jnp.uint32, tuple(shape), d) + jnp.asarray(offsets[d]).astype(jnp.uint32)
        h = mix32(h + idx * jnp.uint32(_GOLDEN))
    return jnp.broadcast_to(h, tuple(local_shape))


def _bits32(x: jax.Array) -> jax.Array:
    """The element's bit pattern as uint32 (8-, 16-, 32-bit dtypes; 64-bit: the two words mixed)."""
    x = jnp.asarray(x)
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if size == 8:
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        return w[..., 0] ^ mix32(w[..., 1] + jnp.uint32(_GOLDEN))
    raise NotImplementedError(f"fingerprint: dtype {x.dtype} (itemsize {size}) is not supported")


# ----------------------------------------------------------------------------------------------------------- sketch
def sketch_shard(x_local, *, path: str, global_shape: Sequence[int], offsets: Sequence[Any], width: int,
                 seed: int) -> jax.Array:
    """f32 [w]: the CountSketch of one shard of the tensor ``path`` (its block ``x_local`` starts at ``offsets`` of the
    global array of shape ``global_shape``). Inside ``shard_map``: ``jax.lax.psum`` the result over the mesh axes the
    tensor is split on. A tensor with ``numel(global_shape) < width`` is not sketched: use ``exact_shard``."""
    _check_width_seed(width, seed)
    x_local = jnp.asarray(x_local)
    if len(offsets) != x_local.ndim or len(global_shape) != x_local.ndim:
        raise ValueError(f"sketch_shard({path!r}): offsets={tuple(offsets)!r} and global_shape={tuple(global_shape)!r}"
                         f" need one entry per dimension of x_local.shape={x_local.shape}")
    if x_local.ndim == 0:
        x_local = x_local.reshape(1)
        offsets = (0,)
    return _sketch_block(x_local, tensor_key(path, seed, _SKETCH_KEY), offsets, width)


def _sketch_block(x_local: jax.Array, key, offsets: Sequence[Any], width: int) -> jax.Array:
    """The CountSketch of a block at ``offsets`` with the sketch key ``key`` (int or traced uint32)."""
    h = _index_hash(key, x_local.shape, offsets)
    bucket = ((h & jnp.uint32(0x7FFFFFFF)) % jnp.uint32(width)).astype(jnp.int32)
    sign = 1.0 - 2.0 * (h >> 31).astype(jnp.float32)
    vals = x_local.astype(jnp.float32) * sign
    # No reshape: flattening a sharded block would make the partitioner gather it; a scatter with [*shape] indices is
    # split over the shards (partial sketches, then one all-reduce).
    return jnp.zeros((width,), jnp.float32).at[bucket].add(vals)


def sketch_keyed(x, key, *, width: int) -> jax.Array:
    """``sketch_array(x, path=...)`` with the tensor's sketch key an input (``tensor_keys(path, seed)[0]``) instead of
    a constant, so that one compiled program serves every tensor of a shape, dtype and sharding. The same arithmetic,
    so the same bits (``tests/gates/test_recorder.py``). Automatic sharding only (the partitioner splits it)."""
    x = jnp.asarray(x)
    if is_exact(x.size, width):
        return x.astype(jnp.float32).reshape(-1)
    return _sketch_block(x, key, (0,) * x.ndim, width)


def is_exact(numel: int, width: int) -> bool:
    """Whether a tensor of ``numel`` elements is kept exactly rather than sketched: ``numel < width`` (strictly, so that
    a stored vector's length says which it is: ``width`` for a sketch, less for exact values)."""
    return int(numel) < int(width)


def exact_shard(x_local, *, global_shape: Sequence[int], offsets: Sequence[Any]) -> jax.Array:
    """f32 [numel]: a small tensor kept exactly, flattened in row-major order; one shard's block is placed at its
    offsets in a zero vector (psum them like the sketches)."""
    x_local = jnp.asarray(x_local).astype(jnp.float32)
    full = jnp.zeros(tuple(int(n) for n in global_shape), jnp.float32)
    if x_local.ndim == 0:
        return x_local.reshape(1)
    full = jax.lax.dynamic_update_slice(full, x_local, tuple(jnp.asarray(o, jnp.int32) for o in offsets))
    return full.reshape(-1)


def _explicit_sharding(x):
    """(mesh, spec) when ``x``'s type carries an explicit sharding over some mesh axes (explicit-sharding mode), else
    None (unsharded, or automatic sharding: the partitioner splits the scatter-add itself)."""
    sh = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sh, "mesh", None), getattr(sh, "spec", None)
    if mesh is None or spec is None or getattr(mesh, "empty", True) or not any(e is not None for e in spec):
        return None
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    if explicit is None or not any(types.get(a) == explicit for a in _spec_axes(spec)):
        return None
    return mesh, spec


def _spec_axes(spec) -> tuple[str, ...]:
    out = []
    for e in spec:
        if e is None:
            continue
        out += list(e) if isinstance(e, tuple) else [e]
    return tuple(out)


def shard_offsets(spec, local_shape: Sequence[int], mesh_shape: Mapping[str, int]) -> list:
    """Inside ``shard_map``: each dimension's global offset of this device's block, from ``jax.lax.axis_index`` of the
    mesh axes ``spec`` splits that dimension over (row-major over a tuple of axes, as ``PartitionSpec`` means)."""
    offsets = []
    entries = tuple(spec) + (None,) * (len(local_shape) - len(tuple(spec)))
    for d, e in enumerate(entries):
        if e is None:
            offsets.append(0)
            continue
        block = 0
        for a in e if isinstance(e, tuple) else (e,):
            block = block * int(mesh_shape[a]) + jax.lax.axis_index(a)
        offsets.append(block * int(local_shape[d]))
    return offsets


def _per_shard(x, fn, mesh, spec):
    """``fn(x_local, offsets)`` on every device's block, psum-combined over the axes ``spec`` uses."""
    axes = _spec_axes(spec)

    def body(xl):
        return jax.lax.psum(fn(xl, shard_offsets(spec, xl.shape, mesh.shape)), axes)

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=jax.sharding.PartitionSpec())(x)


def sketch_array(x, *, path: str, width: int, seed: int) -> jax.Array:
    """f32 [w] (or [numel] exactly when numel < w) of one whole (possibly sharded) array."""
    x = jnp.asarray(x)
    if is_exact(x.size, width):
        return x.astype(jnp.float32).reshape(-1)
    explicit = _explicit_sharding(x)
    if explicit is not None:
        return _per_shard(x, lambda xl, off: sketch_shard(xl, path=path, global_shape=x.shape, offsets=off,
                                                          width=width, seed=seed), *explicit)
    return sketch_shard(x, path=path, global_shape=x.shape, offsets=(0,) * x.ndim, width=width, seed=seed)


def sketch(tree, *, width: int = DEFAULT_WIDTH, seed: int = 0) -> dict[str, jax.Array]:
    """{path: f32 [w]} for every leaf of ``tree`` (path: the "/".join of its keys); leaves with numel < w are kept
    exactly ([numel]). Jit-able; on a sharded global array the partitioner sketches shard-locally and adds the partial
    sketches with one all-reduce (no all-gather)."""
    _check_width_seed(width, seed)
    return {p: sketch_array(x, path=p, width=width, seed=seed) for p, x in named_leaves(tree).items()}


# ------------------------------------------------------------------------------------------------------- fingerprint
def fingerprint_shard(x_local, *, path: str, offsets: Sequence[Any]) -> jax.Array:
    """uint32 [2]: one shard's partial fingerprint (wrapping sums); ``jax.lax.psum`` them over the mesh axes the
    tensor is split on (uint32 addition wraps, so the sum is the unsharded fingerprint exactly)."""
    x_local = jnp.asarray(x_local)
    if x_local.ndim == 0:
        x_local = x_local.reshape(1)
        offsets = (0,)
    if len(offsets) != x_local.ndim:
        raise ValueError(f"fingerprint_shard({path!r}): offsets={tuple(offsets)!r} need one entry per dimension of "
                         f"x_local.shape={x_local.shape}")
    return _fingerprint_block(x_local, [tensor_key(path, 0, salt) for salt in _LANE_KEYS], offsets)


def _fingerprint_block(x_local: jax.Array, lane_keys: Sequence[Any], offsets: Sequence[Any]) -> jax.Array:
    bits = _bits32(x_local)
    lanes = []
    for key in lane_keys:
        h = _index_hash(key, x_local.shape, offsets)
        lanes.append(jnp.sum(mix32(mix32(h ^ bits) + bits * jnp.uint32(_GOLDEN)), dtype=jnp.uint32))
    return jnp.stack(lanes)


def fingerprint_keyed(x, lane_keys) -> jax.Array:
    """``fingerprint_array(x, path=...)`` with the two lane keys an input (``tensor_keys(path, seed)[1:]``), like
    ``sketch_keyed``."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        x = x.reshape(1)
    return _fingerprint_block(x, [lane_keys[0], lane_keys[1]], (0,) * x.ndim)


def fingerprint_array(x, *, path: str) -> jax.Array:
    x = jnp.asarray(x)
    explicit = _explicit_sharding(x)
    if explicit is not None:
        return _per_shard(x, lambda xl, off: fingerprint_shard(xl, path=path, offsets=off), *explicit)
    return fingerprint_shard(x, path=path, offsets=(0,) * x.ndim)


def fingerprint(tree) -> dict[str, jax.Array]:
    """{path: uint32 [2]} bit fingerprints of every leaf of ``tree``; jit-able, sharding-independent."""
    return {p: fingerprint_array(x, path=p) for p, x in named_leaves(tree).items()}


# ------------------------------------------------------------------------------------------------------------ paths
def key_name(k) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return str(k.name)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def named_leaves(tree) -> dict[str, Any]:
    """{"a/b/c": leaf}: the "/".join of each leaf's pytree keys (gates.protocol.tree_to_named's names); a leaf at the
    root is named "value". Two leaves with one name are refused."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(key_name(k) for k in path) or "value"
        if name in out:
            raise ValueError(f"sketch: two leaves are both named {name!r}")
        out[name] = leaf
    return out


# ----------------------------------------------------------------------------------------------------------- metrics
def estimate_sq(sa: np.ndarray, sb: np.ndarray) -> float:
    """``||S(a) - S(b)||^2`` in float64: the (unbiased) estimate of ``||a - b||^2`` (exact for exact-kept tensors)."""
    d = np.asarray(sa, np.float64) - np.asarray(sb, np.float64)
    return float(np.dot(d, d))
