"""Float32 pure-JAX references of the four ops: the truth every kernel and model path is judged against.

Readable first: every reference upcasts its inputs to float32, passes ``precision=HIGHEST`` to every matmul and
einsum, returns float32, and validates its arguments at the boundary with a ``ValueError`` that names the argument.
No Pallas here.
"""
