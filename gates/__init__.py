"""The numerics gates: the three-step RL protocol, run records, the six gates, flag contracts, tolerance reports, CLI.

Public API (importing ``gates`` does not import jax, so ``python -m nxgates`` can set XLA flags first):

    from nxgates import gates
    report = gates.check(config="tiny", flags={"moe_wi_gmm_fused_swiglu": True})
    report.passed                      # bool
    print(report.table())              # per check: gate, step, vs control, vs reference, bounds, verdict
    report.write("reports")            # reports/gates.json + reports/gates.md (atomic)

``gates.check(config, flags=None)`` with ``flags=None`` checks every registered flag alone and the tuned combination.
Bad input (unknown config or flag, malformed value, refused combination) raises a ``ValueError`` subclass
(``model.flags.ConfigError`` or ``gates.errors.BadInput``) naming the key and its value, before anything runs.
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
