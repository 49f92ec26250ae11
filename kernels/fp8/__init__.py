"""fp8 absmax + quantize of stacked expert weights in one Pallas pass (``kernel.py``; ``ops.py`` validates and pads)."""

from nxgates.kernels.fp8.ops import fp8_absmax_quantize as fp8_absmax_quantize
