"""Gated DeltaNet in Pallas: the chunk kernel, its differentiable op, the bf16 XLA baseline, context parallelism.

``kernel.py`` holds the ``pallas_call``s (the chunk kernel and the sequential map scan); ``ops.py`` the validation,
padding, the ``custom_vjp`` op ``gdn_chunk`` and the XLA path ``gdn_chunk_xla``; ``context_parallel.py`` the
``shard_map`` algorithm (``gdn_cp`` inside ``shard_map``, ``gdn_cp_sharded`` around it) with the fold switches;
``inputs.py`` the seeded test inputs shared by the tests and the kernel report.
Tests: ``python -m pytest tests/kernels/test_gdn_kernel.py tests/kernels/test_gdn_cp.py -q``.
"""

from nxgates.kernels.gdn.context_parallel import fold_scan as fold_scan
from nxgates.kernels.gdn.context_parallel import fold_tree as fold_tree
from nxgates.kernels.gdn.context_parallel import gdn_cp as gdn_cp
from nxgates.kernels.gdn.context_parallel import gdn_cp_sharded as gdn_cp_sharded
from nxgates.kernels.gdn.ops import gdn_chunk as gdn_chunk
from nxgates.kernels.gdn.ops import gdn_chunk_xla as gdn_chunk_xla
