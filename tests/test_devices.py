"""``nxgates.devices``: the host-device flag and OpenBLAS's thread count, set before jax is imported."""

import os
import subprocess
import sys

from nxgates import devices

# A child process: the float32 GDN reference's chunked scan, forward and backward, whose triangular solves XLA's CPU
# backend runs as ``lapack_strsm_ffi`` (scipy's OpenBLAS). Prints whether the compiled program calls it
# (``strsm=yes``), then the sha256 of every output's bytes.
_CHILD = r"""
import hashlib, sys
import jax, jax.numpy as jnp, numpy as np
from nxgates.reference.gdn import gdn_chunked

rng = np.random.default_rng(7)
b, t, h, d = 2, 512, 4, 64
q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(3))
k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
g = jnp.asarray(-rng.uniform(0.01, 0.2, (b, t, h)), jnp.float32)
beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.float32)

def loss(q, k, v, g, beta):
    o, s = gdn_chunked(q, k, v, g, beta)
    return jnp.sum(o * o) + jnp.sum(s), o

fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
compiled = fn.lower(q, k, v, g, beta).compile()
print("strsm=" + ("yes" if "lapack_strsm_ffi" in compiled.as_text() else "no"))
out = jax.tree.leaves(compiled(q, k, v, g, beta))
print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in out)).hexdigest())
"""


def _child(threads: str) -> list[str]:
    env = {**os.environ, devices.BLAS_THREADS_VAR: threads, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_openblas_thread_count_changes_no_bit_of_the_gdn_scan():
    one, four = _child("1"), _child("4")
    assert one[0] == "strsm=yes", f"the program no longer reaches OpenBLAS's triangular solve: {one}"
    assert one == four


def test_use_host_devices_sets_one_blas_thread_unless_the_environment_chose(monkeypatch):
    # as before jax is imported (the test process has it; monkeypatch puts it back after the test)
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.delenv(devices.BLAS_THREADS_VAR, raising=False)
    monkeypatch.setenv("XLA_FLAGS", devices.host_device_flag())
    devices.use_host_devices()
    assert os.environ[devices.BLAS_THREADS_VAR] == "1"
    monkeypatch.setenv(devices.BLAS_THREADS_VAR, "3")
    devices.use_host_devices()
    assert os.environ[devices.BLAS_THREADS_VAR] == "3"
