"""Float32 pure-JAX references of the four ops: the truth every kernel and model path is judged against.

Readable first: every reference upcasts its inputs to float32, passes ``precision=HIGHEST`` to every matmul and
einsum, returns float32, and validates its arguments at the boundary with a ``ValueError`` that names the argument.
No Pallas here.
"""

# Explicit re-exports (``name as name``): the public API of DESIGN.md.
from reference.fp8 import fp8_dequantize as fp8_dequantize
from reference.fp8 import fp8_fake_quant as fp8_fake_quant
from reference.fp8 import fp8_quantize as fp8_quantize
from reference.fp8 import fp8_scale as fp8_scale
from reference.gdn import gdn_chunk_maps as gdn_chunk_maps
from reference.gdn import gdn_chunked as gdn_chunked
from reference.gdn import gdn_context_parallel as gdn_context_parallel
from reference.gdn import gdn_fold as gdn_fold
from reference.gdn import gdn_recurrent as gdn_recurrent
from reference.gmm import gmm as gmm
from reference.gmm import tgmm as tgmm
from reference.swiglu import moe_wo_dlhs_dswiglu as moe_wo_dlhs_dswiglu
from reference.swiglu import swiglu as swiglu
from reference.swiglu import swiglu_bwd as swiglu_bwd
