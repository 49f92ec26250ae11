"""Float32 pure-JAX references of the four ops: the truth every kernel and model path is judged against.

Readable first: every reference upcasts its inputs to float32, passes ``precision=HIGHEST`` to every matmul and
einsum, returns float32, and validates its arguments at the boundary with a ``ValueError`` that names the argument.
No Pallas here.
"""

# Explicit re-exports (``name as name``): the public API of docs/design.md.
from nxgates.reference.fp8 import fp8_dequantize as fp8_dequantize
from nxgates.reference.fp8 import fp8_fake_quant as fp8_fake_quant
from nxgates.reference.fp8 import fp8_quantize as fp8_quantize
from nxgates.reference.fp8 import fp8_scale as fp8_scale
from nxgates.reference.gdn import gdn_chunk_maps as gdn_chunk_maps
from nxgates.reference.gdn import gdn_chunked as gdn_chunked
from nxgates.reference.gdn import gdn_context_parallel as gdn_context_parallel
from nxgates.reference.gdn import gdn_fold as gdn_fold
from nxgates.reference.gdn import gdn_recurrent as gdn_recurrent
from nxgates.reference.gmm import gmm as gmm
from nxgates.reference.gmm import tgmm as tgmm
from nxgates.reference.swiglu import moe_wo_dlhs_dswiglu as moe_wo_dlhs_dswiglu
from nxgates.reference.swiglu import swiglu as swiglu
from nxgates.reference.swiglu import swiglu_bwd as swiglu_bwd
