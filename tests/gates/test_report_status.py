"""What a report says about itself (issue 13 items 8 and 9): its status first ("complete" / "incomplete" /
"interrupted" / "stopped"), the date, the command, the commit and source hash; how each record was obtained in this
run; the file mode the umask gives; Ctrl-C and SIGTERM: one line, exit 130, the report marked interrupted (never a
stale one left looking current); ``--fail-fast``: exit 1 at the first failing check, its workers stopped, the report
marked stopped. On the toy model; the signals go to real processes.

Run: python -m pytest tests/gates/test_report_status.py -q
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from nxgates.gates import atomic, cli, runner
from tests.gates import toy_model
from tests.gates.test_cli import tolerance_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
GATHER8 = ["--flags", "fp8_fake_quant_hoist=gather8"]  # an exact flag the toy passes


def run_cli(tmp_path, argv, capsys, cache="cache"):
    code = cli.main(["run", "--config", "toy", "--jobs", "1", "--out", str(tmp_path / "out"), "--cache-dir",
                     str(tmp_path / cache), *argv], api=toy_model.api())
    err = capsys.readouterr().err
    return code, err, json.loads((tmp_path / "out" / "gates.json").read_text()), \
        (tmp_path / "out" / "gates.md").read_text()


def test_status_and_run_identity_come_first(tmp_path, capsys):
    code, err, doc, md = run_cli(tmp_path, GATHER8, capsys)
    assert code == 0, err
    assert list(doc)[0] == "status" and doc["status"] == "complete" and doc["passed"] is True
    run = doc["run"]
    assert run["command"] == f"nxgates run --config toy --jobs 1 --out {tmp_path / 'out'} --cache-dir " \
                             f"{tmp_path / 'cache'} --flags fp8_fake_quant_hoist=gather8"
    assert run["started"].startswith("20") and run["written"] >= run["started"]
    assert len(run["source_sha256"]) == 64 and run["pid"] == os.getpid()
    assert run["git_commit"] is None or len(run["git_commit"].split("+")[0]) == 40
    first = md.splitlines()[0]
    assert first.startswith("**status: COMPLETE (1/1 checks); started 20") and run["command"] in first
    assert f"source sha256 {run['source_sha256'][:16]}" in first


def test_records_say_how_this_run_obtained_them(tmp_path, capsys):
    """First use: "computed"; a later check: "computed; shared: first obtained for ..." (never "shared (computed for
    an earlier check)" for a record this run computed); a cached entry that is damaged: "recomputed: ...", not
    "cached"."""
    code, _, doc, _ = run_cli(tmp_path, [], capsys)
    first, second = doc["checks"][0]["records"], doc["checks"][1]["records"]
    assert first["control"] == "computed" and first["reference"] == "computed", first
    assert second["control"].startswith("computed; shared: first obtained for control["), second
    code, _, doc, _ = run_cli(tmp_path, [], capsys)
    assert doc["checks"][0]["records"]["control"] == "cached"
    for f in (tmp_path / "cache").rglob("*"):  # damage every array file of every entry, and the candidates' entries
        if f.is_file() and (f.suffix == ".npz" or f.parent.name == "candidates"):
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
    code, _, doc, _ = run_cli(tmp_path, [], capsys)
    records = doc["checks"][0]["records"]
    assert all(how.startswith("recomputed: ") for how in records.values()), records


def test_interrupt_after_a_check_marks_the_report(tmp_path, capsys, monkeypatch):
    calls = []
    real = runner.Runner.run_check

    def run_check(self, spec, **kw):
        calls.append(spec.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, spec, **kw)

    monkeypatch.setattr(runner.Runner, "run_check", run_check)
    code, err, doc, md = run_cli(tmp_path, [], capsys)
    assert code == 130
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C) after 1/5 checks")
    assert doc["status"] == "interrupted" and doc["passed"] is False and len(doc["checks"]) == 1
    assert len(doc["pending"]) == 4
    assert md.splitlines()[0].startswith("**status: INTERRUPTED (1/5 checks done before the interrupt")


def test_fail_fast_stops_at_the_first_failing_check(tmp_path, capsys):
    """A table whose floors are 0 fails the toy's first check (a rounding flag: its gradient moves): with
    ``--fail-fast`` the run ends there, exit 1, the failing check explained, the other four named as not run, the
    report marked STOPPED and its verdict FAIL. A passing check does not stop it, and a failing last check leaves
    nothing to stop: that report is complete."""
    strict = tolerance_file(tmp_path, 0.0)
    code, err, doc, md = run_cli(tmp_path, ["--tolerances", strict, "--fail-fast"], capsys)
    assert code == 1, err
    assert doc["status"] == "stopped" and doc["passed"] is False
    assert [c["passed"] for c in doc["checks"]] == [False] and doc["checks"][0]["name"] == "moe_wi_gmm_fused_swiglu"
    assert doc["checks"][0]["explanation"] is not None  # explained after the stop
    assert doc["pending"] == ["fp8_fake_quant_hoist", "wi_tile_fwd_embed_dim=8", "wi_tile_fwd_batch_seq=16", "tuned"]
    assert "stopped at the first failing check (1/5; fail_fast): 4 not run" in err
    assert md.splitlines()[0].startswith("**status: STOPPED AT THE FIRST FAILING CHECK (1/5 checks; --fail-fast")
    assert "**FAIL** (not run fp8_fake_quant_hoist, " in md
    table = cli.main(["run", "--config", "toy", "--jobs", "1", "--out", str(tmp_path / "out"), "--cache-dir",
                      str(tmp_path / "cache"), "--tolerances", strict, "--fail-fast", "--no-explain"],
                     api=toy_model.api())
    assert table == 1
    text = capsys.readouterr().out
    assert "NOT RUN (stopped at the first failing check): fp8_fake_quant_hoist, " in text
    assert "\nFAIL: 0/1 checks pass" in text

    code, err, doc, _ = run_cli(tmp_path, [*GATHER8, "--fail-fast"], capsys)  # an exact flag the toy passes
    assert code == 0 and doc["status"] == "complete" and doc["passed"] is True, err
    code, err, doc, _ = run_cli(tmp_path, ["--flags", "moe_wi_gmm_fused_swiglu=true", "--tolerances", strict,
                                           "--fail-fast", "--no-explain"], capsys)
    assert code == 1 and doc["status"] == "complete" and doc["pending"] == [], err
    assert "stopped at the first failing check" not in err


def test_a_stale_report_is_replaced_before_anything_is_computed(tmp_path, capsys, monkeypatch):
    """The report of an earlier complete run is overwritten by an "incomplete" one before the first model run; a run
    killed at any point leaves a report that says it is not complete."""
    code, _, doc, _ = run_cli(tmp_path, GATHER8, capsys)
    assert doc["status"] == "complete"
    seen = []

    def compute(self, *a, **kw):
        seen.append(json.loads((tmp_path / "out" / "gates.json").read_text()))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Runner, "compute", compute)
    code, err, doc, md = run_cli(tmp_path, GATHER8, capsys, cache="other-cache")
    assert seen and seen[0]["status"] == "incomplete" and seen[0]["checks"] == []
    assert "if process" in seen[0]["status_line"]
    assert code == 130 and doc["status"] == "interrupted" and doc["checks"] == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_files_respect_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert atomic.current_umask() == umask
        p = atomic.write_text_atomic(tmp_path / "r" / "gates.md", "x\n")
        assert p.stat().st_mode & 0o777 == mode
    finally:
        os.umask(old)


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (Linux /proc; elsewhere none are found)."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


DRIVER = """
import sys
from nxgates.devices import use_host_devices
use_host_devices()
from nxgates.gates import cli
from tests.gates import slow_toy
sys.exit(cli.main(sys.argv[1:], api=slow_toy.api(), api_factory="tests.gates.slow_toy:api"))
"""


def _default_sigint():
    """A terminal's program gets Ctrl-C; a job started in the background of a shell (CI, nohup) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler. Give the child the terminal's disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("where, sig, jobs", [("main", signal.SIGINT, "1"), ("workers", signal.SIGINT, "2"),
                                              ("main", signal.SIGTERM, "1")],
                         ids=["ctrl-c", "ctrl-c-during-prefetch", "sigterm"])
def test_a_signal_prints_one_line_and_exits_130(tmp_path, where, sig, jobs):
    """A real process, the signal sent to its whole process group (as a terminal's Ctrl-C is): exit 130, one line
    after the signal, no traceback (nor one per worker), the report marked INTERRUPTED, no worker left."""
    env = {**os.environ, "NXGATES_TEST_SLOW_S": "600", "NXGATES_TEST_SLOW_WHERE": where}
    log = tmp_path / "stderr.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, "run", "--config", "toy", "--jobs", jobs, "--out",
                                 str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")], cwd=ROOT, env=env,
                                stderr=f, stdout=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_default_sigint)
        try:
            deadline = time.time() + 240
            while "building slowly" not in log.read_text():
                assert proc.poll() is None and time.time() < deadline, log.read_text()
                time.sleep(0.3)
            time.sleep(1.0)
            before = len(log.read_text().splitlines())
            os.killpg(proc.pid, sig)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 10  # every process of the run's session ends with it (the prefetch workers too)
    while session_members(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_members(proc.pid)
    text = log.read_text()
    after = text.splitlines()[before:]
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert len(after) == 1 and after[0].startswith(f"interrupted ({name}) after 0/5 checks"), after
    doc = json.loads((tmp_path / "out" / "gates.json").read_text())
    assert doc["status"] == "interrupted"
    assert (tmp_path / "out" / "gates.md").read_text().startswith("**status: INTERRUPTED")


def test_fail_fast_stops_the_prefetch_workers(tmp_path):
    """With workers: the first check fails (a table whose floors are 0) while a worker builds the second check's
    candidate, which sleeps 600 s (``tests/gates/slow_toy.py``). ``--fail-fast`` ends the run there: exit 1 long
    before the sleep ends, no process of the run left, the report stopped after one check. (A run that went on to
    the second check, or that waited for its workers, would sleep out the 600 s and time out here.)"""
    strict = tolerance_file(tmp_path, 0.0)
    env = {**os.environ, "NXGATES_TEST_SLOW_S": "600", "NXGATES_TEST_SLOW_IF": "fp8_fake_quant_hoist"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "run", "--config", "toy", "--jobs", "2", "--out",
                             str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"), "--tolerances", strict,
                             "--fail-fast", "--no-explain"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while session_members(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_members(proc.pid)
    assert proc.returncode == 1, err
    assert "stopped at the first failing check (1/5; fail_fast): 4 not run" in err
    doc = json.loads((tmp_path / "out" / "gates.json").read_text())
    assert doc["status"] == "stopped" and len(doc["checks"]) == 1 and len(doc["pending"]) == 4


def test_prefetch_workers_compute_the_float32_lens_records(tmp_path, capsys):
    """With the lens on, the workers compute its control and each rounding candidate in the lens too, so the checks
    read every record from the cache (the lens is not left to the main process, one record after another)."""
    code = cli.main(["run", "--config", "toy", "--jobs", "2", "--out", str(tmp_path / "out"), "--cache-dir",
                     str(tmp_path / "cache"), "--flags", "moe_wi_gmm_fused_swiglu=true", "--no-explain"],
                    api=toy_model.api(), api_factory="tests.gates.toy_model:api")
    err = capsys.readouterr().err
    assert code in (0, 1), err
    doc = json.loads((tmp_path / "out" / "gates.json").read_text())
    records = doc["checks"][0]["records"]
    assert doc["checks"][0]["lens_passed"] is not None, records  # the lens ran (the repository table has [lens.*])
    for name in ("reference", "candidate", "control-lens", "candidate-lens"):
        assert "by a prefetch worker of this run" in records[name], (name, records)
    assert "prefetch: control-lens computed" in err and "prefetch: candidate-lens[" in err


def test_a_checks_candidate_is_not_kept_in_memory_after_its_gates(tmp_path):
    """The runner keeps the shared control and reference for every check, not each candidate (peak memory)."""
    from nxgates.gates import contracts
    from nxgates.gates import record as record_lib

    r = runner.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)), progress=None,
                      lens=False)
    spec = contracts.build_check("f", {"moe_wi_gmm_fused_swiglu": True}, r.api.as_dict(r.base_flags), r.closure)
    res = r.run_check(spec)
    labels = {label for _, _, label in r._records.values()}
    assert labels == {"control[f]", "reference[f]"}, labels
    again = r.run_check(spec)  # read back from the disk cache: the same verdicts
    assert [g.as_dict() for g in again.results] == [g.as_dict() for g in res.results]
    assert again.records["candidate"] == "cached"
