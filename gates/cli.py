"""The gates command line: ``nxgates [command] [options]`` (= ``python -m nxgates``; the entry sets XLA flags first).

Commands:
    run (default)   python -m nxgates [--config tiny] [--flags k=v ...] [--json] [--out reports]
                    no --flags: every registered flag alone + the tuned combination; exit 0 pass, 1 a gate fails,
                    2 bad input (unknown config or flag, malformed value, refused combination) with the message;
                    --fail-fast: stop at the first failing check (exit 1, the report marked STOPPED).
    kernels         python -m nxgates kernels [--case tiny|cell] [--op moe|gdn|fp8] ...  (gates.kernel_report.main)
                    python -m nxgates kernels --impl PACKAGE.MODULE:FUNCTION --op OP ...  (gates.testing.main)
    calibrate       python -m nxgates calibrate [--config tiny]: control-vs-reference distances and a benign
                    reassociation, the measurements behind fixtures/tolerances.toml [gates.*]
    list-flags      python -m nxgates list-flags [--config tiny]: every tuning flag, its contract, control and tuned
    golden          python -m nxgates golden [--config tiny]: rebuild fixtures/golden/<config>.json from a fresh control
    mutants         python -m nxgates mutants [--config tiny] [--only NAME ...]: deliberately wrong variants must fail
                    exactly their predicted gates (exit 0 when every one does)
    explain         python -m nxgates explain [--config tiny] --flags k=v ... | --mutant NAME ... | --mutants: the first
                    op and layer where the candidate leaves the control at step 1 (gates.explain); exit 0 when no tap
                    is over its bound, 1 otherwise (--mutant/--mutants: 0 once explained)
    resolution      python -m nxgates resolution [--config tiny] [--flags k=v ...] [--eps E ...]: the smallest error
                    of known size, injected into the op each rounding flag changes, that the bf16 gates and the
                    float32 lens fail (gates.resolution); exit 0 when measured, 1 when a flag's own check failed
    false-alarms    python -m nxgates false-alarms [--config tiny] [--only tiles folds seeds] [--seeds N]: benign
                    variants through both lenses (gates.false_alarms); exit 0 when none fails
    compare         python -m nxgates compare CONTROL CANDIDATE [--reference REF] [--contract rounding|exact]
                    [--tolerances FILE] [--json] [--out DIR]: the six gates on recorded runs of any trainer
                    (gates.compare, docs/records.md); exit 0 pass, 1 a gate fails, 2 bad or insufficient records
    calibrate-records  python -m nxgates calibrate-records CONTROL REFERENCE [BENIGN ...] [--out FILE]: rel and
                    slack from a trainer's own records by calibrate's rule, written as a --tolerances file
    import-metrics  python -m nxgates import-metrics METRICS.jsonl OUT_RUN_DIR [--loss-key K] ...: a JSON-lines
                    metrics log (MaxText keys by default) as a record, its logged precision kept (N1, N3)
Global: --accelerator (use the default jax backend instead of 8 host CPU devices; read in gates/__main__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import signal
import sys
import tempfile
import threading
import time

from nxgates.gates.errors import BadInput

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
COMMANDS = ("run", "kernels", "calibrate", "list-flags", "golden", "mutants", "compare", "calibrate-records",
            "import-metrics", "explain", "resolution", "false-alarms")
RECORD_COMMANDS = {"calibrate-records": "calibrate_records", "import-metrics": "metrics_log"}  # records only


def _eps(text: str) -> float:  # argparse names it in its message: "invalid eps value"
    """``--eps`` items: a number in (0, 1) (argparse turns the ValueError into exit 2 naming the value)."""
    value = float(text)
    if not (0.0 < value < 1.0):
        raise ValueError(text)
    return value


_eps.__name__ = "eps"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_flag_items(items: list[str] | None) -> dict[str, str] | None:
    """["k=v", ...] -> {k: v} (strings: model.flags.parse_flags types them); a malformed item raises BadInput."""
    if items is None:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BadInput(f"--flags item {item!r} is malformed: expected key=value "
                           "(e.g. moe_wi_gmm_fused_swiglu=true)")
        if key in out and out[key] != value:
            raise BadInput(f"--flags gives {key} twice: {key}={out[key]} and {key}={value}")
        out[key] = value
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nxgates", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")

    def common(sp, *, out=True):
        sp.add_argument("--config", default="tiny", help="config name (fixtures/configs/<name>.toml); default tiny")
        sp.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
        sp.add_argument("--accelerator", action="store_true", help="use the default jax backend (set before jax loads)")
        sp.add_argument("--cache-dir", default=None, help="record cache (default $NXGATES_CACHE or .cache/gates)")
        sp.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (<cache dir>/xla; gates.profile)")
        if out:
            sp.add_argument("--out", default="reports", help="report folder (default reports/)")

    run = sub.add_parser("run", help="run the gates (default)")
    common(run)
    run.add_argument("--flags", nargs="+", action="extend", metavar="K=V", help="check these flags (one check)")
    run.add_argument("--tiles", choices=("each", "grouped"), default="each",
                     help="without --flags: check each tuned tile key alone (default) or grouped by contract")
    run.add_argument("--no-cache", action="store_true", help="recompute control and reference")
    run.add_argument("--jobs", default="2", metavar="N",
                     help="worker processes that compute the records; each check runs as soon as its records are in "
                          "(default 2; 1: everything in this process)")
    run.add_argument("--tolerances", default=None, help="tolerance table (default fixtures/tolerances.toml)")
    run.add_argument("--profile", action="store_true",
                     help="print per record the seconds to trace, lower, compile and execute, and the totals")
    run.add_argument("--golden-dir", default=None, help="golden records (default fixtures/golden)")
    run.add_argument("--no-explain", action="store_true", help="do not explain the failing checks (gates.explain)")
    run.add_argument("--fail-fast", action="store_true",
                     help="stop at the first failing check (exit 1; the workers stop, the failing check is still "
                          "explained; the report is marked STOPPED and names the checks not run)")
    ex = sub.add_parser("explain", help="the first op and layer where the candidate leaves the control (step 1)")
    common(ex)
    ex.add_argument("--flags", nargs="+", action="extend", metavar="K=V", help="the check to explain")
    ex.add_argument("--mutant", nargs="+", action="extend", metavar="NAME", help="explain these mutants")
    ex.add_argument("--mutants", action="store_true", help="explain every mutant (table: injected op, named op)")
    ex.add_argument("--lens", action="store_true", help="explain in the float32 lens (control and candidate in "
                    "float32 on their own code paths): for a check only the lens fails")
    cal = sub.add_parser("calibrate", help="measure the distances behind the tolerances")
    common(cal)
    cal.add_argument("--benign", nargs="+", action="extend", metavar="K=V",
                     help="the benign reassociation (default: the first k-tile key halved)")
    cal.add_argument("--no-repeat", action="store_true", help="skip the second control run (reproducibility check)")
    cal.add_argument("--lens", action="store_true", help="calibrate the float32 lens ([lens.*]) instead")
    cal.add_argument("--draws", type=int, default=None, help="keep the first N benign draws")
    lf = sub.add_parser("list-flags", help="tuning flags, contracts, control and tuned values")
    lf.add_argument("--config", default="tiny")
    lf.add_argument("--json", action="store_true")
    lf.add_argument("--accelerator", action="store_true")
    gd = sub.add_parser("golden", help="rebuild fixtures/golden/<config>.json from a fresh control run")
    gd.add_argument("--config", default="tiny")
    gd.add_argument("--accelerator", action="store_true")
    gd.add_argument("--golden-dir", default=None)
    mu = sub.add_parser("mutants", help="deliberately wrong variants must fail exactly their predicted gates")
    common(mu)
    mu.add_argument("--only", nargs="+", action="extend", metavar="NAME", help="run only these mutants")
    mu.add_argument("--jobs", default="2", help="worker processes, one mutant each at a time (default "
                    "2; 1: everything in this process)")
    rs = sub.add_parser("resolution", help="the smallest injected error each lens fails, per rounding flag and gate")
    common(rs)
    rs.add_argument("--flags", nargs="+", action="extend", metavar="K=V",
                    help="one check (default: each rounding flag)")
    rs.add_argument("--eps", nargs="+", type=_eps, metavar="E", help="the relative errors to inject (default "
                    "1e-6 .. 1e-1, one per decade)")
    fa = sub.add_parser("false-alarms", help="benign variants must pass both lenses (how many tried, how many failed)")
    common(fa)
    fa.add_argument("--only", nargs="+", action="extend", choices=("tiles", "folds", "seeds"),
                    help="the kinds of variant (default all)")
    fa.add_argument("--seeds", type=int, default=1, help="other batch seeds for the default rounding checks (1)")
    sub.add_parser("kernels", help="per-kernel tolerance report (gates.kernel_report)", add_help=False)
    cmp = sub.add_parser("compare", help="the six gates on recorded runs (docs/records.md)")
    cmp.add_argument("control", help="the control's run directory")
    cmp.add_argument("candidate", help="the candidate's run directory")
    cmp.add_argument("--reference", default=None, help="the reference's run directory (live bounds)")
    cmp.add_argument("--contract", choices=("rounding", "exact"), default="rounding")
    cmp.add_argument("--tolerances", default=None, help="tolerance table (rel, slack per gate)")
    cmp.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the table")
    cmp.add_argument("--out", default=None, help="also write compare.json and compare.md here")
    cmp.add_argument("--accelerator", action="store_true", help="use the default jax backend (set before jax loads)")
    for name, help_ in (("calibrate-records", "rel and slack from a trainer's own control, reference, benign records"),
                        ("import-metrics", "a JSON-lines metrics log as a record (loss, gradient norm)")):
        sp = sub.add_parser(name, help=help_)
        _record_module(name).add_arguments(sp)
        sp.add_argument("--accelerator", action="store_true", help=argparse.SUPPRESS)
    return p


def _record_module(command: str):
    import importlib

    return importlib.import_module(f"nxgates.gates.{RECORD_COMMANDS[command]}")


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so the run stops the same way (report marked, workers stopped)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def ensure_writable(path, what: str) -> pathlib.Path:
    """Create the folder ``path`` if needed and write (and remove) a probe file in it; ``BadInput`` naming ``what``,
    the path and the reason otherwise. Run before anything is computed, so no result is lost at the end."""
    if path is None or not str(path).strip():
        raise BadInput(f"{what}={str(path)!r} must name a folder")
    p = pathlib.Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".nxgates-write-probe.", dir=p)
        os.close(fd)
        os.unlink(probe)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, FileExistsError) or (p.exists() and not p.is_dir()):
            reason = "it is a file, not a folder"
        elif isinstance(e, (NotADirectoryError, FileNotFoundError)):
            reason = f"a part of the path is not a folder ({reason})"
        raise BadInput(f"{what}={str(path)!r} cannot be written: {reason}") from None
    return p


def default_cache_dir() -> str:
    return os.environ.get("NXGATES_CACHE", ".cache/gates")


def parse_jobs(value: str) -> int:
    """``--jobs``: ASCII decimal digits, 1 .. the number of CPUs (a process per record compiles on one core)."""
    cpus = os.cpu_count() or 1
    jobs = int(value) if re.fullmatch(r"[0-9]{1,6}", value.strip(), re.ASCII) else 0
    if not 1 <= jobs <= max(cpus, 2):
        raise BadInput(f"--jobs={value!r} must be an integer from 1 to {max(cpus, 2)} (this machine's CPUs: each "
                       "worker compiles on one core and holds its own records in memory)")
    return jobs


def main(argv: list[str] | None = None, *, api=None, api_factory: str | None = None) -> int:
    """The CLI; returns the exit code (0 pass, 1 a gate fails, 2 bad input, 130 interrupted). ``api``: another model's
    ``ModelAPI`` (tests: the toy); ``api_factory``: "module:function" building it again in prefetch workers."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv, api, api_factory)
    except KeyboardInterrupt as e:  # outside a run's checks (those write their report first, in _run)
        print(f"interrupted ({'SIGTERM' if isinstance(e, _Terminated) else 'Ctrl-C'}): nothing was written",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str], api, api_factory: str | None = None) -> int:
    if argv[0] == "kernels":
        rest = [a for a in argv[1:] if a != "--accelerator"]
        if any(a == "--impl" or a.startswith("--impl=") for a in rest):  # someone's kernel: gates.testing
            from nxgates.gates import testing

            return int(testing.main(rest))
        try:
            from nxgates.gates import kernel_report
        except ImportError as e:
            print(f"error: gates.kernel_report is not available ({e})", file=sys.stderr)
            return EXIT_BAD_INPUT
        return int(kernel_report.main(rest))
    try:
        args = _parser().parse_args(argv)  # argparse prints a message naming the argument
    except SystemExit as e:  # exit 2 (bad argument) or 0 (--help), returned rather than raised
        return int(e.code) if isinstance(e.code, int) else EXIT_BAD_INPUT
    if args.command == "compare":  # records only: no model needed
        from nxgates.gates import compare

        return compare.main(args)
    if args.command in RECORD_COMMANDS:
        try:
            return _record_module(args.command).main(args)
        except ValueError as e:  # RecordError, CompareInputError and bad arguments: named, no traceback
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    from nxgates.gates.model_api import default_model_api

    custom_api = api is not None  # worker processes (run --jobs) can only rebuild the real model package's API
    try:
        api = api or default_model_api()
    except ImportError as e:
        print(f"error: the model package is not importable: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    bad = (BadInput, api.config_error)
    if args.command in ("run", "calibrate", "mutants", "resolution", "false-alarms") and not args.no_compile_cache:
        from nxgates.gates import profile

        if profile.active_compilation_cache_dir() is None:  # (a process may have one already: the test harness's)
            profile.enable_compilation_cache(args.cache_dir)  # compiled programs under <cache dir>/xla/<host>
    try:
        if args.command == "run":
            return _run(args, api, custom_api, argv, api_factory)
        for name in ("out", "cache_dir"):  # every output location, before anything is computed
            if getattr(args, name, False) is not False:
                ensure_writable(getattr(args, name) if name == "out" or args.cache_dir else default_cache_dir(),
                                "--" + name.replace("_", "-"))
        if args.command == "calibrate":
            from nxgates.gates import calibrate

            return calibrate.main(args, api, parse_flag_items(args.benign) if args.benign else None)
        if args.command == "list-flags":
            return _list_flags(args, api)
        if args.command == "golden":
            return _golden(args, api)
        if args.command == "mutants":
            from nxgates.gates import mutants

            args.jobs = parse_jobs(args.jobs)
            return mutants.main(args, api)
        if args.command == "false-alarms":
            from nxgates.gates import false_alarms

            return false_alarms.main(args, api)
        if args.command == "resolution":
            from nxgates.gates import resolution

            return resolution.main(args, api, parse_flag_items(args.flags))
        if args.command == "explain":
            from nxgates.gates import explainer

            return explainer.main(args, api, parse_flag_items(args.flags))
    except bad as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command!r}")


def _run(args, api, custom_api: bool, argv: list[str], api_factory: str | None = None) -> int:
    from nxgates.gates import suite

    flags = parse_flag_items(args.flags)
    jobs = parse_jobs(args.jobs)
    out = ensure_writable(args.out, "--out")
    if not args.no_cache:
        ensure_writable(args.cache_dir or default_cache_dir(), "--cache-dir")
    if args.tolerances is not None and not pathlib.Path(args.tolerances).is_file():
        raise BadInput(f"--tolerances={args.tolerances!r} is not a file")
    if args.golden_dir is not None and not pathlib.Path(args.golden_dir).is_dir():
        raise BadInput(f"--golden-dir={args.golden_dir!r} is not a folder")
    t0 = time.perf_counter()
    rows = [] if args.profile else None
    command = "nxgates " + " ".join(shlex.quote(a) for a in argv)
    try:
        report = suite.check(args.config, flags, api=api if custom_api else None, tiles=args.tiles,
                             cache_dir=args.cache_dir, use_cache=not args.no_cache, tolerances_path=args.tolerances,
                             golden_dir=args.golden_dir, progress=_progress,
                             on_check=lambda partial: partial.write(out), jobs=jobs, command=command,
                             accelerator=args.accelerator, api_factory=api_factory, profile=rows,
                             explain=not args.no_explain, fail_fast=args.fail_fast)
    except suite.Interrupted as e:
        e.report.write(out)
        why = "SIGTERM" if isinstance(e.__context__, _Terminated) else "Ctrl-C"
        print(f"interrupted ({why}) after {len(e.report.checks)}/{len(e.report.checks) + len(e.report.pending)} "
              f"checks; {out / 'gates.md'} is marked INTERRUPTED", file=sys.stderr)
        return EXIT_INTERRUPTED
    json_path, md_path = report.write(out)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.table())
    if rows is not None:
        from nxgates.gates import profile

        print(f"\nprofile ({time.perf_counter() - t0:.1f}s wall in all):\n{profile.table(rows)}")
    _progress(f"wrote {json_path} and {md_path} ({time.perf_counter() - t0:.1f}s)")
    return EXIT_PASS if report.passed else EXIT_FAIL


def _list_flags(args, api) -> int:
    from tabulate import tabulate

    from nxgates.gates import contracts

    cfg = api.load_config(args.config)
    base = api.as_dict(api.base_flags(cfg))
    tuned = api.tuned(cfg)
    rows = []
    for key in base:
        if not contracts.is_tuning_key(key):
            continue
        decl = contracts.declaration(key)
        rows.append({"flag": key, "contract": decl.contract, "control": base[key], "tuned": tuned.get(key, "-"),
                     "op": decl.op, "rules": ",".join(decl.rules), "what": decl.doc})
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(f"tuning flags of config {args.config!r} (the check of a flag also turns on the prerequisite "
              "tuning flags the model's rules name)")
        shown = [{k: v for k, v in r.items() if k != "rules"} for r in rows]  # the rules: --json, or model.flags
        print(tabulate(shown, headers="keys", tablefmt="simple", disable_numparse=True))
    return EXIT_PASS


def _golden(args, api) -> int:
    from nxgates.gates import golden, runner

    r = runner.Runner(args.config, api=api, use_cache=False, progress=_progress)
    ensure_writable(golden.golden_path(args.config, args.golden_dir).parent, "--golden-dir")  # before computing
    rec = r.compute(r.base_flags, "production", "control (golden)")
    try:
        path = golden.write_golden(args.config, rec, args.golden_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(f"wrote {path}: loss {[float(s.loss) for s in rec.steps]}, grad norms "
          f"{[float(s.grad_norm) for s in rec.steps]}")
    return EXIT_PASS
