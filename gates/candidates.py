"""A candidate's entry in the record cache: its digests against the control and the reference, not its tensors.

A check reads of its candidate only what ``gates.gates.evaluate`` needs: the digests of the pairs (candidate,
control) and (candidate, reference) (``gates.gates.PairDigest``: N1, N2, N6 and the per-tensor gradient sums of
every step, bit identity per gate, the preconditions), the candidate's metadata and how many of its own routing
choices differed from the replayed ones. The cache keeps exactly that, a few kilobytes in one JSON file, instead of
the candidate's full record (about 136 MB on tiny); the gates computed from it are the same numbers to the bit.

An entry is stored under the candidate's program key together with the control's and the reference's
(``entry_key``), so a control or reference that changes makes it unreachable rather than wrong. The file carries the
sha256 of its body and its key parts; one that does not match them is rejected (``CacheEntryInvalid``) and the
candidate recomputed. Written atomically (``gates.atomic``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from nxgates.gates import atomic
from nxgates.gates import gates as gates_lib
from nxgates.gates.record import CacheEntryInvalid, RunRecord, canonical_json, key_digest

FORMAT_VERSION = 1
FOLDER = "candidates"  # under the record cache's root


@dataclasses.dataclass(frozen=True)
class CandidateSummary:
    """What a check reads of its candidate (the record itself is not kept)."""

    metadata: dict[str, Any]
    routing_mismatch: tuple[int, ...]  # per step: the candidate's own top-k choices that differed from the replayed
    vs_control: gates_lib.PairDigest
    vs_reference: gates_lib.PairDigest

    @classmethod
    def of(cls, candidate: RunRecord, control: RunRecord, reference: RunRecord) -> CandidateSummary:
        return cls(metadata=json.loads(canonical_json(candidate.metadata)),
                   routing_mismatch=tuple(int(s.routing_mismatch) for s in candidate.steps),
                   vs_control=gates_lib.pair_digest(candidate, control),
                   vs_reference=gates_lib.pair_digest(candidate, reference))

    def to_json(self) -> dict:
        return {"metadata": self.metadata, "routing_mismatch": list(self.routing_mismatch),
                "vs_control": self.vs_control.to_json(), "vs_reference": self.vs_reference.to_json()}

    @classmethod
    def from_json(cls, obj: Mapping) -> CandidateSummary:
        try:
            return cls(metadata=dict(obj["metadata"]), routing_mismatch=tuple(int(x) for x in obj["routing_mismatch"]),
                       vs_control=gates_lib.PairDigest.from_json(obj["vs_control"]),
                       vs_reference=gates_lib.PairDigest.from_json(obj["vs_reference"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"candidate summary: malformed ({type(e).__name__}: {e})") from None


def entry_key(candidate: str, control: str, reference: str) -> dict:
    """The key parts of a candidate's entry: the digests of the three records' program keys
    (``gates.provenance.program_record_key``)."""
    return {"format": FORMAT_VERSION, "candidate": candidate, "control": control, "reference": reference}


def _body_sha256(body: Mapping) -> str:
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def entry_path(root: str | pathlib.Path, key_parts: Mapping[str, Any]) -> pathlib.Path:
    return pathlib.Path(root) / FOLDER / f"{key_digest(key_parts)}.json"


def store(root: str | pathlib.Path, key_parts: Mapping[str, Any], summary: CandidateSummary) -> pathlib.Path:
    body = summary.to_json()
    doc = {"key": json.loads(canonical_json(key_parts)), "body": body, "sha256": _body_sha256(body)}
    # Python's JSON, non-finite floats as Infinity / NaN: every float reads back as the same float64
    return atomic.write_text_atomic(entry_path(root, key_parts), json.dumps(doc, sort_keys=True) + "\n")


def load(root: str | pathlib.Path, key_parts: Mapping[str, Any]) -> CandidateSummary:
    """The stored summary; ``FileNotFoundError``, or ``CacheEntryInvalid`` saying why it is not trusted."""
    path = entry_path(root, key_parts)
    text = path.read_bytes()  # FileNotFoundError: no entry
    try:
        saved = json.loads(text)
        body = saved["body"]
        if saved.get("sha256") != _body_sha256(body):
            raise CacheEntryInvalid(f"{path}: changed since it was written (sha256 mismatch)")
        if saved.get("key") != json.loads(canonical_json(key_parts)):
            raise CacheEntryInvalid(f"{path}: stale entry, its key parts differ from the requested ones")
        return CandidateSummary.from_json(body)
    except CacheEntryInvalid:
        raise
    except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8 and shape errors
        raise CacheEntryInvalid(f"{path}: unreadable ({type(e).__name__}: {e})") from None
