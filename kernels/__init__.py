"""Optimized Pallas kernels (TPU-style: sequential grid, VMEM accumulators) with their ``custom_vjp`` wrappers.

One folder per op (``gmm/``, ``gdn/``, ``fp8/``), each with ``kernel.py`` (the ``pallas_call``) and ``ops.py`` (the
differentiable wrapper and validation). Every kernel takes ``interpret``: on CPU it runs in the Pallas interpreter.
"""
