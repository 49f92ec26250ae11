"""The numerics gates: the three-step RL protocol, run records, the six gates, flag contracts, tolerance reports, CLI.

Public API (importing ``gates`` does not import jax, so ``python -m nxgates`` can set XLA flags first):

    from nxgates import gates
    report = gates.check(config="tiny", flags={"moe_wi_gmm_fused_swiglu": True})
    report.passed                      # bool
    print(report.table())              # per check: gate, step, vs control, vs reference, bounds, verdict
    report.write("reports")            # reports/gates.json + reports/gates.md (atomic)

``gates.check(config, flags=None)`` with ``flags=None`` checks every registered flag alone and the tuned combination.
Bad input (any argument of the wrong kind, unknown config or flag, malformed value, refused combination, unreadable
tolerance table) raises a ``ValueError`` subclass (``model.flags.ConfigError`` or ``gates.errors.BadInput``) naming
the key and its value, before anything runs. In a plain interpreter ``check`` asks XLA for the 8 host CPU devices the
default mesh needs (``nxgates.devices.use_host_devices``); if jax already started with fewer, the ``RuntimeError``
names what to set (``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``, or call
``nxgates.devices.use_host_devices()`` before importing jax). Ctrl-C raises ``gates.suite.Interrupted`` (a
``KeyboardInterrupt``) whose ``report`` holds the checks done, status "interrupted".
"""

from __future__ import annotations

__all__ = ["check", "explain", "BadInput", "Report"]


def check(config: str = "tiny", flags=None, **kwargs):
    """See ``gates.suite.check``."""
    from nxgates.gates.suite import check as _check

    return _check(config, flags, **kwargs)


def explain(config: str = "tiny", flags=None, candidate_context=None, **kwargs):
    """See ``gates.explainer.explain``: the first op and layer where the candidate leaves the control, at step 1."""
    from nxgates.gates.explainer import explain as _explain

    return _explain(config, flags, candidate_context, **kwargs)


def __getattr__(name):
    if name == "BadInput":
        from nxgates.gates.errors import BadInput

        return BadInput
    if name == "Report":
        from nxgates.gates.report import Report

        return Report
    raise AttributeError(f"module 'gates' has no attribute {name!r}")
