"""How far lossless compression would shrink the record cache: the full tensors of cached records, compressed.

    python benchmarks/record_compression.py CACHE_ENTRY [CACHE_ENTRY ...]   # run directories under the record cache

Per record and step it prints the raw size of the full tensors (``param/*``, ``grad/*``) and their size compressed
with zlib (level 1) after a byte shuffle (the four bytes of each float32 grouped, so that the exponents compress):
the gradients as they are, the parameters as they are and as the XOR of their bits with the previous step's (a small
update changes only the low mantissa bits, so the XOR is mostly zeros; the XOR undoes itself, so this is lossless).
The summaries and the small arrays are left out (a few hundred kB per record).
"""

from __future__ import annotations

import json
import pathlib
import sys
import zlib

import numpy as np


def packed(a: np.ndarray) -> int:
    """zlib level 1 of the byte-shuffled 32-bit words of ``a``: compressed bytes."""
    words = np.ascontiguousarray(a).view(np.uint32)
    return len(zlib.compress(words.view(np.uint8).reshape(-1, 4).T.tobytes(), 1))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    total_raw = total_packed = 0
    for entry in map(pathlib.Path, argv):
        steps = sorted((entry / "steps").glob("*.npz"))
        if not steps:
            print(f"{entry}: no steps/*.npz (not a record's run directory)", file=sys.stderr)
            return 2
        meta = json.loads((entry / "meta.json").read_text())
        raw = best = 0
        prev: dict[str, np.ndarray] = {}
        for path in steps:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files if k.startswith(("param/", "grad/"))}
            if any(a.dtype.itemsize != 4 for a in arrays.values()):
                print(f"{path}: a full tensor is not 32-bit; this estimate covers float32 records", file=sys.stderr)
                return 2
            grads = {k: a for k, a in arrays.items() if k.startswith("grad/")}
            params = {k: a for k, a in arrays.items() if k.startswith("param/")}
            g = sum(packed(a) for a in grads.values())
            p = sum(packed(a) for a in params.values())
            x = sum(packed(a.view(np.uint32) ^ prev[k].view(np.uint32)) if k in prev else packed(a)
                    for k, a in params.items())
            step_raw = sum(a.nbytes for a in arrays.values())
            print(f"{entry.name[:12]} {path.stem}: raw {step_raw / 1e6:6.1f} MB; gradients {g / 1e6:5.1f} MB, "
                  f"parameters {p / 1e6:5.1f} MB, as XOR with the previous step {x / 1e6:5.1f} MB")
            raw += step_raw
            best += g + min(p, x)
            prev = params
        print(f"{entry.name[:12]} ({meta.get('flags', {}).get('precision')}): {raw / 1e6:.1f} MB raw, "
              f"{best / 1e6:.1f} MB compressed")
        total_raw += raw
        total_packed += best
    print(f"all: {total_raw / 1e6:.1f} MB raw, {total_packed / 1e6:.1f} MB compressed "
          f"({total_packed / max(total_raw, 1):.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
