"""nxgates: numerics gates for a MoE + Gated DeltaNet RL trainer.

The repository keeps one top-level folder per layer (``reference/``, ``kernels/``, ``model/``, ``gates/``,
``fixtures/``); an install exposes them under this one package, so nxgates can sit in a trainer's environment without
claiming generic top-level names:

    nxgates.reference   float32 pure-JAX references (the truth)
    nxgates.kernels     Pallas kernels with their custom_vjp wrappers
    nxgates.model       the small model of the trainer's architecture, its config and flags
    nxgates.gates       the protocol, records, the six gates, reports and the CLI
    nxgates.fixtures    configs, the tolerance table and golden records (data)

Importing ``nxgates`` does not import jax (the CLI sets XLA flags first). ``python -m nxgates`` and the console
script ``nxgates`` run the CLI.
"""

__version__ = "0.2.0"

