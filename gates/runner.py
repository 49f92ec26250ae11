"""The check runner: one config, its control and float32 reference shared by every check, then the six gates.

For each check (a ``gates.contracts.CheckSpec``): the control (config flags + the check's control prerequisites,
production precision) and the float32 reference (same flags, ``precision="reference"``) come from the record cache,
computed once per (config, control flags) and reused by every candidate; the candidate (control + the check's flags) is
cached as its digests against the control and the reference (``gates.candidates``: a few kilobytes, not its record)
unless a mutant's override or loss is in effect (then always computed fresh); then the six gates. A ``rounding`` check
also looks through the float32 lens: the control and the candidate again on their own code paths with float32
activations and weights (``precision="lens"``), gated against the same float32 reference with the ``[lens.*]``
tolerances; the check passes only if both lenses pass (an ``exact`` check is bit-identity on the bf16 path, which the
lens cannot tighten). Every flag combination is parsed and validated before anything runs, so a refused combination
costs no compile.

The model is reached through a ``gates.model_api.ModelAPI``; a record's key is ``gates.provenance.record_key``; a
whole run (the default checks or ``--flags``, the golden comparison, the report) is ``gates.suite.check``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from nxgates.gates import atomic, protocol
from nxgates.gates import candidates as candidates_lib
from nxgates.gates import contracts as contracts_lib
from nxgates.gates import gates as gates_lib
from nxgates.gates import profile as profile_lib
from nxgates.gates import record as record_lib
from nxgates.gates.errors import BadInput
from nxgates.gates.model_api import ModelAPI, default_model_api
from nxgates.gates.provenance import (
    arrays_digest,
    environment,
    program_record_key,
    record_key,
    routing_digest,
    source_hash,
)
from nxgates.gates.tolerances import Tolerances, load_tolerances, read_table


def control_routing(control: record_lib.RunRecord) -> list | None:
    """The control's per-step routing for the other runs to replay (None for a model without routing)."""
    return protocol.replay_routing(control.steps)


def _has_lens(path: str) -> bool:
    try:
        return "lens" in read_table(path)
    except ValueError:  # a table given in memory (tests): no file to read [lens.*] from
        return False


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class CheckResult:
    spec: contracts_lib.CheckSpec
    control_flags: dict
    candidate_flags: dict
    results: list[gates_lib.GateResult]
    problems: list[str]
    implementations: dict
    records: dict  # label -> how it was obtained ("cached" / "computed" / "recomputed: ...")
    wall_s: float
    # Routing replay: per step, the (layer, token) pairs whose own top-k differed from the control's replayed choice,
    # {"candidate": [...], "reference": [...]}; empty for a model without routing.
    routing_mismatch: dict = dataclasses.field(default_factory=dict)
    # A failing check's explanation (gates.explainer.Explanation, or a str saying why there is none); None: not asked.
    explanation: object = None
    # The float32 lens (rounding checks; None when not run): the gates on the float32 control and candidate.
    lens_results: list[gates_lib.GateResult] | None = None
    lens_problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def bf16_passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.results)

    @property
    def lens_passed(self) -> bool | None:
        """The float32 lens's verdict; None when the lens did not run (exact checks, ``lens=False``)."""
        if self.lens_results is None:
            return None
        return not self.lens_problems and all(r.passed for r in self.lens_results)

    @property
    def passed(self) -> bool:
        return self.bf16_passed and self.lens_passed is not False

    @property
    def environment(self) -> list[str]:
        """Live control-to-reference distances outside their calibrated ranges (reported, not failures)."""
        lens = [f"lens {r.environment}" for r in self.lens_results or () if r.environment]
        return [r.environment for r in self.results if r.environment] + lens

    @property
    def first_failing_step(self) -> int | None:
        failing = [r.step for r in self.results if not r.passed]
        return min(failing) if failing else None

    @property
    def worst_tensor(self) -> tuple[str | None, float]:
        """The tensor with the largest gradient rel L2 against the control (N5) over the steps."""
        n5 = [r for r in self.results if r.gate == "N5"]
        if not n5:
            return None, 0.0
        worst = max(n5, key=lambda r: r.vs_control)
        return worst.worst_tensor, worst.vs_control


class Runner:
    """Runs checks on one config, sharing controls and references between them."""

    def __init__(
        self,
        config: str,
        *,
        api: ModelAPI | None = None,
        settings: protocol.ProtocolSettings = protocol.DEFAULT_SETTINGS,
        cache: record_lib.RecordCache | None = None,
        use_cache: bool = True,
        tolerances: Tolerances | None = None,
        progress: Callable[[str], None] | None = stderr,
        lens: bool | None = None,
        lens_tolerances: Tolerances | None = None,
        batch_case: str = "batch",
    ):
        """``batch_case``: the case id the batch's seed derives from (``<config>/<batch_case>``; another one gives
        other tokens, mask and advantages: ``gates.false_alarms``)."""
        self.api = api or default_model_api()
        self.config_name = config
        self.cfg = self.api.load_config(config)  # unknown name -> ConfigError naming it
        self.settings = settings
        self.progress = progress or (lambda msg: None)
        self.cache = cache or record_lib.RecordCache(log=self.progress)
        self.use_cache = use_cache
        self.tolerances = tolerances or load_tolerances()
        # The float32 lens runs when asked, or by default when the table has its [lens.*] bounds (or they are given).
        if lens is None:
            lens = lens_tolerances is not None or _has_lens(self.tolerances.path)
            if not lens:
                self.progress(f"float32 lens off: no [lens.*] in {self.tolerances.path} "
                              "(calibrate it: python -m nxgates calibrate --lens --config tiny)")
        self.lens = lens
        self._lens_tolerances = lens_tolerances
        self.base_flags = self.api.base_flags(self.cfg)
        self.env = environment()
        self.seeds = {"params": protocol.seed_for(f"{config}/params"),
                      "batch": protocol.seed_for(f"{config}/{batch_case}")}
        batch_size, seq_len, vocab = self.api.dims(self.cfg)
        self.batch = protocol.make_batch(batch_size, seq_len, vocab, self.seeds["batch"])
        self._params0 = None
        # key digest -> (record, how it was obtained in this run, the label it was first obtained for)
        self._records: dict[str, tuple[record_lib.RunRecord, str, str]] = {}
        # key digest -> how a prefetch worker of this run obtained it ("computed", "recomputed: <why>", "cached")
        self.prefetched: dict[str, str] = {}
        # key digest -> the digest of the record's program key (what a candidate's cache entry is keyed by)
        self._program_keys: dict[str, str] = {}
        # (control key digest, reference key digest) -> their PairDigest, computed once per run
        self._pairs: dict[tuple[str, str], gates_lib.PairDigest] = {}
        self._src_hash = source_hash(self.api.source_dirs, extra=self.api.config_files(config))
        self._inputs_sha256: tuple[str, str] | None = None  # (params0, batch) digests for the program keys
        self.profile: list[dict] = []  # one ``gates.profile.row`` per record obtained (``nxgates run --profile``)
        self.source_sha256 = self._src_hash
        self.t0 = time.perf_counter()

    @property
    def lens_tolerances(self) -> Tolerances:
        """``[lens.*]`` of the gate table's file (read on first use)."""
        if self._lens_tolerances is None:
            self._lens_tolerances = load_tolerances(self.tolerances.path, section="lens")
        return self._lens_tolerances

    # ---------------------------------------------------------------------------------------------------- flags
    def flags_from(self, overrides: Mapping[str, Any], base=None):
        return self.api.parse_flags(dict(overrides), base if base is not None else self.base_flags)

    def resolve(self, spec: contracts_lib.CheckSpec):
        """(control_flags, candidate_flags), both validated; ConfigError on a refused combination."""
        control = self.flags_from(spec.control_overrides)
        candidate = self.flags_from(spec.candidate_overrides, control)
        self.api.validate(self.cfg, control)
        self.api.validate(self.cfg, candidate)
        return control, candidate

    def closure(self, overrides: Mapping[str, Any]) -> dict:
        """``overrides`` + the prerequisite tuning flags the model's rules need (identity without a model closure)."""
        if self.api.with_prerequisites is None:
            return dict(overrides)
        return self.api.with_prerequisites(self.cfg, overrides)

    def default_specs(self, tiles: str = "each") -> list[contracts_lib.CheckSpec]:
        return contracts_lib.default_checks(self.api.as_dict(self.base_flags), self.api.tuned(self.cfg),
                                            self.closure, tiles=tiles)

    def user_spec(self, flags: Mapping[str, Any]) -> contracts_lib.CheckSpec:
        """A check from user flags: tuning keys go to the candidate, configuration keys to both sides. As in the
        default run, the candidate also gets the prerequisite tuning flags the model's rules name, at the config's
        tuned values (the model's closure); ``added_prerequisites`` of the spec says which. Keys the user chose are
        never changed: where no tuned value satisfies a rule, the refusal names the setting that would."""
        if not flags:
            raise BadInput("flags={} names no flag; omit --flags to check every registered flag")
        parsed = self.api.as_dict(self.flags_from(flags))  # unknown key / malformed value -> ConfigError
        base = self.api.as_dict(self.base_flags)
        tuning = {k: parsed[k] for k in flags if contracts_lib.is_tuning_key(k)}
        config_keys = {k: parsed[k] for k in flags if not contracts_lib.is_tuning_key(k)}
        changed = {k: v for k, v in tuning.items() if base.get(k) != v}
        if not changed:
            shown = ", ".join(f"{k}={v!r}" for k, v in flags.items())
            raise BadInput(f"flags {shown}: no tuning flag differs from config {self.config_name!r}'s control, "
                           "nothing to check")
        name = ",".join(f"{k}={v}" for k, v in changed.items())
        if config_keys and self.api.with_prerequisites is not None:
            # the closure runs on the control the user chose (their control settings on both sides)
            cfg = dataclasses.replace(self.cfg, control=self.flags_from(config_keys))
            closure = functools.partial(self.api.with_prerequisites, cfg)
        else:
            closure = self.closure
        # The user's keys, in full (an explicit value equal to the control's is a choice the closure must keep too).
        chosen = {**changed, **{k: v for k, v in tuning.items() if k not in changed}}
        spec = contracts_lib.build_check(name, chosen, base, closure)
        added = {k: v for k, v in spec.candidate_overrides.items() if k not in flags}
        return dataclasses.replace(spec, keys=tuple(changed), control_overrides=config_keys, added_prerequisites=added)

    # -------------------------------------------------------------------------------------------------- records
    def params0(self):
        if self._params0 is None:
            self._params0 = self.api.init_params(self.cfg, self.seeds["params"])
        return self._params0

    def key_parts(self, flags, precision: str, replay=None) -> dict:
        """The cache key of the record of ``flags`` at ``precision`` replaying ``replay`` (``record_key``)."""
        return record_key(config=self.config_name, config_values=self.api.as_dict(self.cfg),
                          flags=self.api.as_dict(flags), precision=precision, settings=self.settings.as_dict(),
                          seeds=self.seeds, env=self.env, source_sha256=self._src_hash, replay=replay,
                          sketch=protocol.DEFAULT_SKETCH.to_json())

    def compute(self, flags, precision: str, label: str, *, loss_fn=protocol.grpo_loss,
                replay=None, lookup=None, summaries: bool = True, on_steps=None) -> record_lib.RunRecord:
        """A fresh run of ``flags`` at ``precision``. ``lookup(fn, program_sha256)``: ``run_protocol``'s lookup, given
        the built model function too (a record it returns is returned instead of compiling and running).
        ``summaries=False``: without the sketches (a candidate, kept as its digests only). ``on_steps``:
        ``run_protocol``'s (called with the routing the steps used, before the summaries)."""
        self.progress(f"[{time.perf_counter() - self.t0:7.1f}s] {label}: tracing + compiling ({precision})")
        mesh = self.api.make_mesh(flags)
        fn = self.api.build_log_probs(self.cfg, flags, precision=precision, mesh=mesh)
        params = self.params0()
        if self.api.place_params is not None:
            params = self.api.place_params(params, mesh)
        meta = {"config": self.config_name, "config_values": self.api.as_dict(self.cfg),
                "flags": self.api.as_dict(flags), "precision": precision, "seeds": self.seeds, "env": self.env,
                "source_sha256": self._src_hash, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        t = time.perf_counter()

        def progress(msg):
            self.progress(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}")

        if replay is not None:
            meta["routing_replay_sha256"] = routing_digest(replay)
        rec = protocol.run_protocol(fn, params, self.batch, self.settings, metadata=meta, loss_fn=loss_fn,
                                    progress=progress, label=label, replay=replay,
                                    lookup=None if lookup is None else functools.partial(lookup, fn),
                                    summaries=summaries, on_steps=on_steps)
        rec.metadata["implementations"] = dict(self.api.implementations(fn))
        rec.metadata["run_s"] = round(time.perf_counter() - t, 3)
        return rec

    def shared_record(self, flags, precision: str, label: str, replay=None, *,
                      on_steps=None) -> tuple[record_lib.RunRecord, str]:
        """Control or reference: once per (flags, precision, replayed routing) in this process, and through the disk
        cache. Returns (record, how): "computed" (in this run), "cached" (from an earlier run), "recomputed: <why the
        cached entry was rejected>", with " (by a prefetch worker of this run)" for a record a worker obtained, and
        "; shared: first obtained for <label>" when an earlier use in this run obtained it. ``on_steps``: passed to
        ``run_protocol`` when the record is computed here (not called for a record read from the cache)."""
        parts = self.key_parts(flags, precision, replay)
        k = record_lib.key_digest(parts)
        if k in self._records:
            rec, how, first = self._records[k]
            return rec, f"{how}; shared: first obtained for {first}"
        t, c = time.perf_counter(), time.process_time()
        if self.use_cache:
            with self.cache.lock(k):  # another process computing it: wait, then read it
                rec, how = self._cached_or_computed(k, flags, precision, label, replay, on_steps)
            if how == "cached" and k in self.prefetched:  # a worker of this run put it there: say how it got it
                how = f"{self.prefetched[k]} (by a prefetch worker of this run)"
        else:
            rec, how = self.compute(flags, precision, label, replay=replay, on_steps=on_steps), "computed"
        self._records[k] = (rec, how, label)
        self._profile(label, (rec, how), t, c)
        return rec, how

    def program_key_parts(self, fn, program_sha256: str, flags, precision: str, replay=None) -> dict:
        """The key the record of ``fn``'s lowered program is stored under (``program_record_key``)."""
        if self._inputs_sha256 is None:
            params0 = protocol.tree_to_named(self.params0())
            batch = {"tokens": self.batch.tokens, "completion_mask": self.batch.completion_mask,
                     "advantages": self.batch.advantages}
            self._inputs_sha256 = (arrays_digest(params0), arrays_digest(batch))
        return program_record_key(
            program_sha256=program_sha256, params0_sha256=self._inputs_sha256[0], batch_sha256=self._inputs_sha256[1],
            config=self.config_name, config_values=self.api.as_dict(self.cfg), flags=self.api.as_dict(flags),
            precision=precision, settings=self.settings.as_dict(), env=self.env,
            implementations=self.api.implementations(fn), replay=replay, sketch=protocol.DEFAULT_SKETCH.to_json())

    def _alias_path(self, digest: str) -> pathlib.Path:
        return pathlib.Path(self.cache.root) / "by-source" / f"{digest}.json"

    def _named_program_key(self, digest: str) -> dict | None:
        """The program key ``by-source/<digest>.json`` names (None: no name, or one that cannot be read)."""
        try:
            return json.loads(self._alias_path(digest).read_text())["program_key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _cached_or_computed(self, digest: str, flags, precision: str, label: str, replay, on_steps=None):
        """(record, how) through the record cache. The record is stored under its program's key
        (``program_key_parts``); ``by-source/<digest>.json`` names that key for ``digest`` (the sources' key,
        ``key_parts``), so an unchanged source tree finds it without building anything, and after an edit that
        changes no program the lowered program finds it (one trace and lowering, no compile, no run)."""
        alias = self._alias_path(digest)
        how = "computed"
        program_parts = self._named_program_key(digest)
        if program_parts is not None:
            try:
                rec = self.cache.load(program_parts)
                self.progress(f"{label}: cached (record {record_lib.key_digest(program_parts)})")
                self._program_keys[digest] = record_lib.key_digest(program_parts)
                return rec, "cached"
            except FileNotFoundError:
                pass
            except record_lib.CacheEntryInvalid as e:
                how = f"recomputed: {e}"
                self.progress(f"{label}: cache entry rejected, recomputing: {e}")
        found: dict = {}

        def lookup(fn, program_sha256):
            found["parts"] = parts = self.program_key_parts(fn, program_sha256, flags, precision, replay)
            try:
                rec = self.cache.load(parts)
            except FileNotFoundError:
                return None
            except record_lib.CacheEntryInvalid as e:
                found["how"] = f"recomputed: {e}"
                self.progress(f"{label}: cache entry rejected, recomputing: {e}")
                return None
            found["hit"] = True
            self.progress(f"{label}: cached, the same program (record {record_lib.key_digest(parts)})")
            return rec

        rec = self.compute(flags, precision, label, replay=replay, lookup=lookup, on_steps=on_steps)
        if found.get("hit"):
            how = "cached (the same program and inputs)"
        else:
            how = found.get("how", how)
            self.cache.store(found["parts"], rec)
        atomic.write_json_atomic(alias, {"program_key": found["parts"]})
        self._program_keys[digest] = record_lib.key_digest(found["parts"])
        return rec, how

    def stored_by_source(self, flags, precision: str, replay=None, *, candidate: bool = False) -> bool:
        """Whether this tree's sources' key finds a stored entry without building anything: the record of ``flags``
        at ``precision`` replaying ``replay``, or (``candidate``) the candidate's digests against its control (the
        config's, at ``precision``) and the float32 reference. Only that the files exist: a caller that reads the
        entry still verifies it (``_cached_or_computed``, ``_cached_candidate``) and computes it when it is damaged.
        ``prefetch`` asks it so that a run whose records are stored starts no worker process for them."""
        if not self.use_cache:
            return False
        digest = record_lib.key_digest(self.key_parts(flags, precision, replay))
        if not candidate:
            return self._stored_program_key(digest) is not None
        parts = self._named_program_key(digest)
        control = self._stored_program_key(record_lib.key_digest(
            self.key_parts(self.base_flags, precision, replay if precision != "production" else None)))
        reference = self._stored_program_key(record_lib.key_digest(self.key_parts(self.base_flags, "reference",
                                                                                  replay)))
        if parts is None or control is None or reference is None:
            return False
        entry = candidates_lib.entry_key(record_lib.key_digest(parts), control, reference)
        return candidates_lib.entry_path(self.cache.root, entry).is_file()

    def _profile(self, label: str, obtained: tuple[record_lib.RunRecord, str], t: float, c: float) -> None:
        """A ``gates.profile.row`` for a record obtained since wall clock ``t`` and process CPU time ``c``."""
        rec, how = obtained
        self.profile.append(profile_lib.row(label, how, rec.metadata, time.perf_counter() - t,
                                            time.process_time() - c))

    # ---------------------------------------------------------------------------------------------------- checks
    def run_check(self, spec: contracts_lib.CheckSpec, *, candidate_loss_fn=protocol.grpo_loss,
                  candidate_context=None, lens: bool | None = None) -> CheckResult:
        """Control, reference, candidate, gates (and the float32 lens for a rounding check). ``candidate_context``: a
        context manager active while the candidate is traced (the mutants inject through ``model.ops.override`` this
        way), or a zero-argument factory of one (called for each candidate trace: needed when the lens runs too).
        ``lens``: run the float32 lens for this check (None: the runner's ``lens``)."""
        t = time.perf_counter()
        control_flags, candidate_flags = self.resolve(spec)
        control, how_c = self.shared_record(control_flags, "production", f"control[{spec.name}]")
        # Routing replay: the reference and the candidate take the control's expert choices at every step.
        replay = control_routing(control)
        reference, how_r = self.shared_record(control_flags, "reference", f"reference[{spec.name}]", replay)
        candidate, how_cand = self._candidate(candidate_flags, "production", f"candidate[{spec.name}]",
                                              candidate_loss_fn, candidate_context, replay,
                                              (control_flags, "production"), control_flags)
        results, problems = gates_lib.evaluate_digests(
            candidate.vs_control, candidate.vs_reference,
            self._pair(control_flags, "production", control_flags, replay), spec.contract, self.tolerances)
        lens_results, lens_problems = None, []
        if (self.lens if lens is None else lens) and spec.contract == "rounding":
            _, how_lc = self.shared_record(control_flags, "lens", f"control-lens[{spec.name}]", replay)
            lens_candidate, how_lk = self._candidate(candidate_flags, "lens", f"candidate-lens[{spec.name}]",
                                                     candidate_loss_fn, candidate_context, replay,
                                                     (control_flags, "lens"), control_flags)
            lens_results, lens_problems = gates_lib.evaluate_digests(
                lens_candidate.vs_control, lens_candidate.vs_reference,
                self._pair(control_flags, "lens", control_flags, replay), spec.contract, self.lens_tolerances)
            how_cand = {"candidate": how_cand, "control-lens": how_lc, "candidate-lens": how_lk}
        return CheckResult(
            spec=spec,
            control_flags=spec.control_overrides,
            candidate_flags=spec.candidate_overrides,
            results=results,
            problems=problems,
            implementations={"candidate": candidate.metadata.get("implementations", {}),
                             "control": control.metadata.get("implementations", {}),
                             "reference": reference.metadata.get("implementations", {})},
            records={"control": how_c, "reference": how_r,
                     **(how_cand if isinstance(how_cand, dict) else {"candidate": how_cand})},
            wall_s=round(time.perf_counter() - t, 2),
            routing_mismatch={} if replay is None else {
                "candidate": list(candidate.routing_mismatch),
                "reference": [s.routing_mismatch for s in reference.steps]},
            lens_results=lens_results,
            lens_problems=lens_problems,
        )

    def _pair(self, flags_a, precision_a: str, control_flags, replay) -> gates_lib.PairDigest:
        """The digest of (the record of ``flags_a`` at ``precision_a``, the reference of ``control_flags``), once
        per run: the control's (or the lens's control's) distance to the reference, shared by every check."""
        ka = record_lib.key_digest(self.key_parts(flags_a, precision_a, replay if precision_a != "production"
                                                  else None))
        kr = record_lib.key_digest(self.key_parts(control_flags, "reference", replay))
        if (ka, kr) not in self._pairs:
            a = self._records[ka][0]
            r = self._records[kr][0]
            self._pairs[(ka, kr)] = gates_lib.pair_digest(a, r)
        return self._pairs[(ka, kr)]

    def candidate_summary(self, flags, precision: str, label: str, replay, control_flags=None):
        """(``gates.candidates.CandidateSummary``, how) of the plain candidate ``flags`` at ``precision``
        ("production" or the lens's "lens"), against its control (``control_flags``, default the config's, at the
        same precision) and the float32 reference, through the cache. A prefetch worker calls it."""
        control_flags = self.base_flags if control_flags is None else control_flags
        return self._candidate(flags, precision, label, protocol.grpo_loss, None, replay, (control_flags, precision),
                               control_flags)

    def _candidate(self, flags, precision: str, label: str, loss_fn, context, replay, control, control_flags):
        """The candidate's ``CandidateSummary`` at ``precision`` against ``control`` ((flags, precision)) and the
        reference of ``control_flags``: a plain candidate is determined by its key like the control, so it is cached
        (as its digests: re-running a check after a tolerance edit costs no model run); a mutated one (override, loss)
        never goes near the cache, and ``context`` is entered around its trace alone."""
        ctrl_replay = replay if control[1] != "production" else None

        def records():  # the full control and reference: read (or computed) where the digests must be formed
            return (self.shared_record(control[0], control[1], f"control ({label})", ctrl_replay)[0],
                    self.shared_record(control_flags, "reference", f"reference ({label})", replay)[0])

        if context is None and loss_fn is protocol.grpo_loss and self.use_cache:
            k = record_lib.key_digest(self.key_parts(flags, precision, replay))
            kc = record_lib.key_digest(self.key_parts(control[0], control[1], ctrl_replay))
            kr = record_lib.key_digest(self.key_parts(control_flags, "reference", replay))
            kc_program, kr_program = self._stored_program_key(kc), self._stored_program_key(kr)
            if kc_program is None or kr_program is None:
                records()  # not stored under this tree's names yet: obtain them first (computed, waited for or found)
                kc_program, kr_program = self._stored_program_key(kc), self._stored_program_key(kr)
            t, c = time.perf_counter(), time.process_time()
            with self.cache.lock(k):  # another process computing it: wait, then read it
                summary, how = self._cached_candidate(k, flags, precision, label, replay, records, kc_program,
                                                      kr_program)
            if how == "cached" and k in self.prefetched:  # a worker of this run put it there: say how it got it
                how = f"{self.prefetched[k]} (by a prefetch worker of this run)"
            self.profile.append(profile_lib.row(label, how, summary.metadata, time.perf_counter() - t,
                                                time.process_time() - c))
            return summary, how
        ctrl_rec, ref_rec = records()
        tc = time.perf_counter(), time.process_time()
        if context is not None and not hasattr(context, "__enter__"):
            context = context()  # a factory: a fresh context for each trace (the bf16 candidate, then the lens)
        with context if context is not None else contextlib.nullcontext():
            rec = self.compute(flags, precision, label, loss_fn=loss_fn, replay=replay, summaries=False)
        self._profile(label, (rec, "computed"), *tc)
        return candidates_lib.CandidateSummary.of(rec, ctrl_rec, ref_rec), "computed"

    def _stored_program_key(self, digest: str) -> str | None:
        """The program key (its digest) of the record whose sources' key is ``digest``: as this process obtained it,
        or as this tree's by-source name gives it where that entry is stored (None: neither). A candidate's entry is
        keyed by its control's and its reference's program keys, so finding it needs their keys, not their
        records."""
        if digest in self._program_keys:
            return self._program_keys[digest]
        parts = self._named_program_key(digest)
        if parts is None or not (self.cache.path(parts) / record_lib.ENTRY_CHECKSUM).is_file():
            return None
        return record_lib.key_digest(parts)

    def _cached_candidate(self, digest: str, flags, precision: str, label: str, replay, records,
                          control_program: str, reference_program: str):
        """(summary, how) of a plain candidate through the cache: ``by-source/<digest>.json`` names its program key
        (as for a record, ``_cached_or_computed``); its entry is keyed by that and the control's and the reference's
        program keys (``gates.candidates.entry_key``). After an edit that changes no program, the lowered program
        finds the entry (one trace and lowering, no compile, no run). ``records()`` gives the full control and
        reference; it is called only where the digests are formed, so a prefetch worker that finds the candidate reads
        neither record (about 1 s of CPU on tiny). ``_candidate`` obtains both program keys first (with the cache
        on, every control and reference has one)."""
        root = self.cache.root
        how = "computed"

        def entry(program_parts):
            return candidates_lib.entry_key(record_lib.key_digest(program_parts), control_program, reference_program)

        alias = self._alias_path(digest)
        program_parts = self._named_program_key(digest)
        if program_parts is not None:
            try:
                summary = candidates_lib.load(root, entry(program_parts))
                self.progress(f"{label}: cached (candidate {record_lib.key_digest(entry(program_parts))})")
                return summary, "cached"
            except FileNotFoundError:
                pass
            except record_lib.CacheEntryInvalid as e:
                how = f"recomputed: {e}"
                self.progress(f"{label}: cache entry rejected, recomputing: {e}")
        found: dict = {}

        def lookup(fn, program_sha256):
            found["parts"] = parts = self.program_key_parts(fn, program_sha256, flags, precision, replay)
            try:
                summary = candidates_lib.load(root, entry(parts))
                found["hit"] = summary
                self.progress(f"{label}: cached, the same program (candidate {record_lib.key_digest(entry(parts))})")
                return summary
            except FileNotFoundError:
                pass
            except record_lib.CacheEntryInvalid as e:
                found["how"] = f"recomputed: {e}"
                self.progress(f"{label}: cache entry rejected, recomputing: {e}")
                return None
            try:  # the candidate's full record, where one is stored (``calibrate`` keeps its candidates' records)
                rec = self.cache.load(parts)
            except (FileNotFoundError, record_lib.CacheEntryInvalid):
                return None
            found["record"] = True
            self.progress(f"{label}: read from its cached record (record {record_lib.key_digest(parts)})")
            return rec

        rec = self.compute(flags, precision, label, replay=replay, lookup=lookup, summaries=False)
        if "hit" in found:
            summary, how = found["hit"], "cached (the same program and inputs)"
        elif "record" in found:
            summary, how = candidates_lib.CandidateSummary.of(rec, *records()), "cached (its full record)"
            candidates_lib.store(root, entry(found["parts"]), summary)
        else:
            how = found.get("how", how)
            summary = candidates_lib.CandidateSummary.of(rec, *records())
            candidates_lib.store(root, entry(found["parts"]), summary)
        atomic.write_json_atomic(alias, {"program_key": found["parts"]})
        return summary, how

    def drop_records(self) -> None:
        """Forget the full records this runner holds (a later use reads them again from the cache): a prefetch worker
        that takes another task does not carry them through that task's compile."""
        self._records.clear()

    def base_control(self) -> tuple[record_lib.RunRecord, str] | None:
        """The config's own control if this runner has it (for the golden comparison)."""
        k = record_lib.key_digest(self.key_parts(self.base_flags, "production"))
        found = self._records.get(k)
        return None if found is None else (found[0], found[1])
