"""Where the time goes (``nxgates run --profile``) and the persistent compilation cache: a record computed from a
cached executable has the same bits as one compiled afresh.

Run: python -m pytest tests/gates/test_profile.py -q
"""

from __future__ import annotations

import copy
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from nxgates.gates import profile
from nxgates.gates import protocol as P
from nxgates.gates import record as record_lib


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0


@functools.lru_cache(maxsize=1)
def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("fsdp",))  # Auto axes, as the model's mesh


def _model(vocab: int):
    """A log-prob model on an 8-device mesh with an interpreted Pallas kernel in its forward (as the real model's
    kernels run on CPU), sharded parameters and bf16 compute."""

    def log_probs(p, tokens):
        x = jax.nn.one_hot(tokens[:, :-1], vocab, dtype=jnp.bfloat16)
        logits = (x @ p["w"].astype(jnp.bfloat16)).astype(jnp.float32)  # [B, S-1, V]
        bias = pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct(p["b"].shape, jnp.float32),
                              interpret=True)(jax.lax.stop_gradient(p["b"]))
        logp = jax.nn.log_softmax(logits + p["b"] * bias, axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], {"dropped_tokens": 0}

    return log_probs


def _run():
    vocab = 16
    batch = P.make_batch(8, 12, vocab, P.seed_for("xla-cache-B8-S12-V16"))
    rng = np.random.default_rng(P.seed_for("xla-cache-params"))
    params = {"w": rng.standard_normal((vocab, vocab)).astype(np.float32) * 0.1,
              "b": rng.standard_normal(vocab).astype(np.float32) * 0.1}
    spec = jax.sharding.PartitionSpec
    layout = {"w": jax.sharding.NamedSharding(_mesh(), spec("fsdp")), "b": jax.sharding.NamedSharding(_mesh(), spec())}
    params = jax.device_put(params, layout)
    return P.run_protocol(_model(vocab), params, batch)


def _flat(rec: record_lib.RunRecord) -> dict[str, np.ndarray]:
    return {f"{i}/{k}": v for i, arrays in record_lib.step_arrays(rec).items() for k, v in arrays.items()}


def assert_same_bits(a: record_lib.RunRecord, b: record_lib.RunRecord) -> None:
    """Every array of two records has the same dtype, shape and bytes."""
    xa, xb = _flat(a), _flat(b)
    assert sorted(xa) == sorted(xb)
    for k in xa:
        assert xa[k].dtype == xb[k].dtype and xa[k].shape == xb[k].shape, k
        assert xa[k].tobytes() == xb[k].tobytes(), f"{k} differs"


@pytest.fixture
def compile_events():
    """The persistent cache's hits and misses while the test runs."""
    seen = {"hits": 0, "misses": 0}

    def listen(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            seen["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            seen["misses"] += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(listen)


@pytest.fixture
def fresh_compile_cache(tmp_path):
    """JAX's persistent compilation cache in an empty folder for this test; the previous one afterwards."""
    before = profile.active_compilation_cache_dir()
    path = profile.enable_compilation_cache(tmp_path)
    jax.clear_caches()
    try:
        yield path
    finally:
        jax.clear_caches()
        if before is None:
            jax.config.update("jax_compilation_cache_dir", None)
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
        else:
            profile.use_compilation_cache_dir(before)


def test_a_cache_hit_gives_the_same_bits(fresh_compile_cache, compile_events):
    """A run that compiles (and writes the cache), then the same run from the cached executables: every loss, log-prob,
    gradient and parameter has the same bits; the second run compiled neither of the protocol's two programs."""
    first = _run()
    written = [p for p in fresh_compile_cache.iterdir() if p.name.startswith(("jit_grad_step", "jit_opt_step"))]
    assert len(written) == 2, sorted(p.name for p in fresh_compile_cache.iterdir())
    jax.clear_caches()  # nothing compiled stays in memory: the second run must read the folder
    hits = compile_events["hits"]
    second = _run()
    assert compile_events["hits"] - hits >= 2
    assert_same_bits(first, second)
    assert first.metadata["phases"]["compile_s"] > 0 and second.metadata["phases"]["stablehlo_bytes"] > 0
    # the comparison is not vacuous: one flipped bit of one gradient fails it
    other = copy.deepcopy(second)
    name = sorted(other.steps[0].grads)[0]
    other.steps[0].grads[name].view(np.uint32).flat[0] ^= 1
    with pytest.raises(AssertionError, match="differs"):
        assert_same_bits(first, other)


def test_the_cache_folder_names_the_host_cpu(tmp_path, monkeypatch):
    """Executables are compiled for the host CPU: the folder is ``<root>/xla/<host id>``, and $NXGATES_CACHE is the
    default root."""
    path = profile.compilation_cache_dir(tmp_path)
    assert path == tmp_path / "xla" / profile.host_id() and len(profile.host_id()) == 16
    monkeypatch.setenv("NXGATES_CACHE", str(tmp_path / "env"))
    assert profile.compilation_cache_dir() == tmp_path / "env" / "xla" / profile.host_id()


def test_profile_rows_and_totals():
    """A computed record's phases count in the totals; a cached one's are shown in brackets and do not."""
    meta = {"phases": {"trace_s": 1.0, "lower_s": 2.0, "compile_s": 30.0, "stablehlo_bytes": 4096,
                       "execute_s": [5.0, 1.0, 1.0], "summaries_s": 0.5}}
    rows = [profile.row("control", "computed", meta, 40.0, 45.0),
            profile.row("reference", "cached", meta, 0.5, 0.4)]
    assert rows[0]["execute_s"] == 7.0 and rows[0]["stablehlo_kb"] == 4 and rows[1]["computed"] is False
    text = profile.table(rows)
    total = text.splitlines()[-1].split()
    assert total[:3] == ["total", "1", "computed"]
    assert total[5:11] == ["1.0", "2.0", "30.0", "7.0", "0.5", "4"]  # the cached row's phases are not added
    assert "(30.0)" in text
    assert "peak RSS MB" in text.splitlines()[0] and total[-1] == f"{max(r['peak_rss_mb'] for r in rows):.0f}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_profile_row_peak_rss_is_this_process_in_mb():
    """A row's peak RSS is this process's, in MB: at least the 200 MB just touched here, and no more than the
    largest resident set /proc reports for it (VmHWM, kB)."""
    block = np.ones(200_000_000 // 8)  # 200 MB, every page written
    value = profile.row("control", "computed", {}, 1.0, 1.0)["peak_rss_mb"]
    hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    assert float(block.sum()) == block.size
    assert 200 <= value <= hwm_kb / 1e3 + 1, (value, hwm_kb)


# ------------------------------------------------------------------------------------------- records keyed by program
def _program_of(log_probs) -> str:
    """The sha256 ``run_protocol`` reports to its lookup (the run stops there: nothing compiled or executed)."""
    seen = []

    def lookup(sha):
        seen.append(sha)
        return "found"

    assert P.run_protocol(log_probs, {"w": jnp.eye(5, dtype=jnp.float32)}, P.make_batch(2, 6, 5, 3),
                          lookup=lookup) == "found"
    return seen[0]


def _logits_a(p, tokens):
    """One docstring."""
    x = jax.nn.one_hot(tokens[:, :-1], 5) @ p["w"]
    return jnp.take_along_axis(jax.nn.log_softmax(x, -1), tokens[:, 1:, None], -1)[..., 0], {"dropped_tokens": 0}


def _logits_b(p, tokens):
    """Another docstring, other comments, other line numbers: the same program."""
    # a comment

    x = jax.nn.one_hot(tokens[:, :-1], 5) @ p["w"]  # the same computation
    return jnp.take_along_axis(jax.nn.log_softmax(x, -1), tokens[:, 1:, None], -1)[..., 0], {"dropped_tokens": 0}


def _logits_c(p, tokens):
    """A real change: the logits scaled."""
    x = jax.nn.one_hot(tokens[:, :-1], 5) @ p["w"] * 1.5
    return jnp.take_along_axis(jax.nn.log_softmax(x, -1), tokens[:, 1:, None], -1)[..., 0], {"dropped_tokens": 0}


def test_the_program_digest_ignores_docstrings_and_comments_not_computations():
    assert _program_of(_logits_a) == _program_of(_logits_b)
    assert _program_of(_logits_a) != _program_of(_logits_c)


def test_an_edit_that_changes_no_program_finds_the_record(tmp_path, monkeypatch):
    """Through the runner and the record cache (toy model): computed once; an unchanged tree reads it by its sources'
    key; after an edit that changes the sources' hash but no program, it is found after one lowering, nothing
    compiled (a compile here fails the test); other initial parameters (the same program) or another program (an
    override of the activation) are computed."""
    from nxgates.gates import runner as runner_lib
    from tests.gates import toy_model

    def runner():
        return runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(tmp_path), progress=None)

    r = runner()
    first, how = r.shared_record(r.base_flags, "production", "control")
    assert how == "computed"
    r = runner()
    again, how = r.shared_record(r.base_flags, "production", "control")
    assert how == "cached"
    assert_same_bits(first, again)

    compile_program = P._compile
    monkeypatch.setattr(P, "_compile", lambda *a: pytest.fail("compiled a program the cache has"))
    r = runner()
    r._src_hash = "an edited docstring"
    edited, how = r.shared_record(r.base_flags, "production", "control")
    assert how.startswith("cached (the same program"), how
    assert_same_bits(first, edited)
    r = runner()
    r._src_hash = "an edited docstring"
    assert r.shared_record(r.base_flags, "production", "control")[1] == "cached"  # by the sources' key now

    monkeypatch.setattr(P, "_compile", compile_program)
    r = runner()
    r._src_hash = "other initial parameters"
    r._params0 = jax.tree.map(lambda a: np.asarray(a) * 2.0, r.params0())
    assert r.shared_record(r.base_flags, "production", "control")[1] == "computed"
    r = runner()
    r._src_hash = "another activation"
    with toy_model.override("activation", jax.nn.gelu):
        assert r.shared_record(r.base_flags, "production", "control")[1] == "computed"


def test_the_sources_key_names_a_config_file_by_its_name_not_its_folder(tmp_path):
    """The same config file in two folders (two clones of a tree, a cache shared between checkouts) gives the same
    key, so a record is read by its sources' key wherever the tree lies; other data or another file name does not."""
    from nxgates.gates import provenance

    def key(folder, name="tiny.toml", text="[model]\nhidden = 64\n"):
        path = tmp_path / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return provenance.source_hash(dirs=(), files=(), extra=[path])

    here = key("checkout-a/fixtures/configs")
    assert key("elsewhere/b") == here
    assert key("elsewhere/c", text="[model]\nhidden = 65\n") != here
    assert key("elsewhere/d", name="smoke.toml") != here


def test_the_sources_key_ignores_docstrings_comments_and_layout_not_code(tmp_path):
    """An edit of a docstring, a comment or the layout keeps the sources' key (the record is read, nothing lowered);
    a code edit, or a changed config value, does not."""
    from nxgates.gates import provenance

    def digest(name, text):
        (tmp_path / name).write_text(text)
        return provenance.code_bytes(tmp_path / name)

    base = digest("a.py", '"""Module."""\n\n\ndef f(x):\n    """One."""\n    return x + 1\n')
    other = '"""Other."""\n# note\n\ndef f(x):  # why\n    """Two."""\n    return (x +\n            1)\n'
    assert digest("b.py", other) == base
    assert digest("c.py", '"""Module."""\n\n\ndef f(x):\n    """One."""\n    return x + 2\n') != base
    assert digest("d.py", "def f(x):\n    return 'a string that is not a docstring', x + 1\n") != base
    cfg = digest("a.toml", "# comment\n[model]\nhidden = 64\nlayers = 2\n")
    assert digest("b.toml", "[model]\nlayers = 2  # why\nhidden = 64\n") == cfg
    assert digest("c.toml", "[model]\nhidden = 65\nlayers = 2\n") != cfg
    assert digest("broken.py", "def f(:\n") == b"def f(:\n"  # does not parse: its bytes
