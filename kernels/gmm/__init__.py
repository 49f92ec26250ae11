"""MoE grouped matmuls in Pallas: ragged GMM / tgmm, the fused SwiGLU forward and backward, and ``moe_mlp``.

``kernel.py`` holds the ``pallas_call``s and the group metadata; ``ops.py`` the validation, padding and ``custom_vjp``
wrappers. Tests: ``python -m pytest tests/kernels/test_gmm.py tests/kernels/test_moe_mlp.py -q``.
"""

from nxgates.kernels.gmm.ops import GmmTiles as GmmTiles
from nxgates.kernels.gmm.ops import dswiglu_gmm as dswiglu_gmm
from nxgates.kernels.gmm.ops import gmm as gmm
from nxgates.kernels.gmm.ops import moe_mlp as moe_mlp
from nxgates.kernels.gmm.ops import swiglu_gmm as swiglu_gmm
from nxgates.kernels.gmm.ops import tgmm as tgmm
from nxgates.kernels.gmm.ops import unfused_dswiglu_bwd as unfused_dswiglu_bwd
from nxgates.kernels.gmm.ops import unfused_swiglu_fwd as unfused_swiglu_fwd
