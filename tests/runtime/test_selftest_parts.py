"""The self-test's parts that need no device: the report and its schema, secrets kept out, the nominal PCIe
figure, the options, and a child process that hangs or crashes told as a finding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

import xlakit
from tests.support import REPO
from tests.support.cli import as_a_user
from xlakit import cli, selftest
from xlakit.cli import selftest as cli_selftest
from xlakit.selftest import check_ranks, children, environment, pcie, report

SECRET = "s3cr3t-" + "k" * 40  # a cache key (at least 32 bytes), never to be shown
VALIDATOR = jsonschema.Draft202012Validator(report.schema())


def _report(*checks: dict) -> dict:
    names = {c["name"] for c in checks}
    rest = [report.skipped(n, "not selected") for n in report.NAMES if n not in names]
    return report.assemble([*checks, *rest], backend={"name": "cpu", "description": "torch on the CPU"},
                           manifest=None, env={"PJRT_DEVICE": "CPU"}, job=environment.job() | {
                               "cache_settings_set_aside": []}, quick=True, started=time.time(), duration_s=1.5)


def test_the_schema_is_valid_and_takes_every_kind_of_check():
    jsonschema.Draft202012Validator.check_schema(report.schema())
    r = _report(report.check("stack", report.PASS, "all good", timings_s={"stack_process": 2}),
                report.failed("memory", "CPU:0: the live count moved by 0 bytes", "attach this report"))
    VALIDATOR.validate(r)
    assert [c["name"] for c in r["checks"]] == list(report.NAMES) and r["status"] == "fail"


@pytest.mark.parametrize("change", ["fail without fix", "skip with fix", "unknown name", "four checks",
                                    "unknown status"])
def test_the_schema_refuses_a_malformed_report(change):
    r = _report(report.failed("memory", "it broke", "fix it"))
    memory = r["checks"][2]
    if change == "fail without fix":
        del memory["fix"]
    elif change == "skip with fix":
        r["checks"][4]["fix"] = "nothing to fix"
    elif change == "unknown name":
        memory["name"] = "disk"
    elif change == "four checks":
        r["checks"].pop()
    else:
        memory["status"] = "warn"
    assert not VALIDATOR.is_valid(r)


def test_a_check_without_its_reason_cannot_be_made():
    with pytest.raises(ValueError, match="needs its reason"):
        report.check("memory", report.SKIP, "skipped")
    with pytest.raises(ValueError, match="expected a check in"):
        report.check("disk", report.PASS, "fine")


def test_text_names_each_check_with_its_fix_or_reason():
    text = report.render(_report(report.failed("checkpoint", "w: the bytes differ", "attach this report")))
    lines = text.splitlines()
    assert lines[0] == "xlakit selftest %s --quick: torch on the CPU" % report.assemble(
        [], backend={}, manifest=None, env={}, job={}, quick=False, started=0, duration_s=0)["xlakit"]
    assert "FAIL  checkpoint: w: the bytes differ" in lines and "      fix: attach this report" in lines
    assert "skip  ranks: not selected" in lines and lines[-2] == "env: PJRT_DEVICE=CPU"
    assert lines[-1] == "0 passed, 1 failed, 4 skipped in 1.5 s (report schema xlakit-selftest/1)"


def test_secrets_are_shown_as_set_never_their_value(monkeypatch):
    monkeypatch.setenv("XLAKIT_CACHE_KEY", SECRET)
    monkeypatch.setenv("XLAKIT_CACHE_TIER_URL", "https://user:hunter22@example.com/cache")
    monkeypatch.setenv("JAX_SOME_TOKEN", "tok-123456")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-abcdef")  # not a variable that matters: not listed
    env = environment.variables()
    from xlakit import _C

    assert env["XLAKIT_CACHE_KEY"] == (f"<set: {len(SECRET)} bytes, id {_C.cache_key_id(SECRET.encode())}; "
                                       "value <not shown>>")
    assert env["JAX_SOME_TOKEN"] == "<set: 10 bytes; value <not shown>>" and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["XLAKIT_CACHE_TIER_URL"] == "https://<not shown>@example.com/cache"
    found = {"reason": f"it printed {SECRET} and aws-abcdef", "nested": [{"x": "tok-123456 here"}]}
    scrubbed = json.dumps(environment.scrub(found, environment.secret_values()))
    assert all(s not in scrubbed for s in (SECRET, "aws-abcdef", "tok-123456")), scrubbed


def test_a_token_in_a_urls_query_or_a_password_with_a_slash_is_not_shown(monkeypatch):
    # Regression: only a URL's user:password was hidden; a token in its query string
    # (?access_token=..., a signed URL's signature) reached the report, and so did a password holding "/".
    monkeypatch.setenv("XLAKIT_CACHE_TIER_URL", "https://storage.example.com/b/x?access_token=ya29.tok&X-Amz-Signature=f00d#frag")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "http://admin:pa/ss@host:1234/x")
    env = environment.variables()
    assert env["XLAKIT_CACHE_TIER_URL"] == ("https://storage.example.com/b/x?access_token=<not shown>"
                                            "&X-Amz-Signature=<not shown>#frag")
    assert env["JAX_COORDINATOR_ADDRESS"] == "http://<not shown>@host:1234/x"
    scrubbed = environment.scrub({"reason": "GET https://h/o?sig=abc123 failed"}, [])
    assert scrubbed == {"reason": "GET https://h/o?sig=<not shown> failed"}


def test_the_children_run_without_the_jobs_cache_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_READ_ONLY", "1")
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", str(tmp_path))
    env = environment.child_env()
    assert not {"XLAKIT_PJRT_CACHE_READ_ONLY", "XLA_PERSISTENT_CACHE_PATH",
                "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"} & set(env)
    assert environment.child_env(set_aside=False)["XLA_PERSISTENT_CACHE_PATH"] == str(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(selftest.__file__).resolve().parents[2])


def _fake_sysfs(root: Path, address: str, speed: str, width: str, vendor: str = "0x10de") -> None:
    """A stand-in for /sys/bus/pci/devices (a fake: the real one describes this machine's bus)."""
    d = root / address
    d.mkdir(parents=True)
    for name, value in (("current_link_speed", speed), ("current_link_width", width), ("vendor", vendor)):
        (d / name).write_text(value + "\n")


def test_the_nominal_figure_is_the_negotiated_pcie_link(tmp_path):
    _fake_sysfs(tmp_path, "0000:00:05.0", "16.0 GT/s PCIe", "16", pcie.GOOGLE_VENDOR)
    _fake_sysfs(tmp_path, "0000:00:04.0", "2.5 GT/s PCIe", "1")
    _fake_sysfs(tmp_path, "0000:00:06.0", "Unknown", "0")
    gen4 = pcie.link("0000:00:05.0", tmp_path)
    assert gen4["link"] == "PCIe 16 GT/s x16" and gen4["bytes_per_s"] == pytest.approx(31.5e9, rel=1e-3)
    assert pcie.link("0000:00:04.0", tmp_path)["bytes_per_s"] == pytest.approx(0.25e9)
    assert pcie.lane_bytes_per_s(64) == pytest.approx(64e9 * 242 / 256 / 8)
    assert "unreadable link" in pcie.link("0000:00:06.0", tmp_path)["why_not"]
    assert "no PCIe link figures" in pcie.link("0000:00:07.0", tmp_path)["why_not"]
    assert pcie.first_of_vendor(pcie.GOOGLE_VENDOR, tmp_path) == "0000:00:05.0"
    assert "the CPU backend" in pcie.nominal("cpu")["why_not"]


def test_the_report_file_of_each_rank_is_its_own():
    one, two = {"rank": 1, "world": 1}, {"rank": 1, "world": 2}
    assert cli_selftest.report_path("out/r.json", one) == Path("out/r.json")
    assert cli_selftest.report_path("out/r.json", two) == Path("out/r.rank1.json")
    assert cli_selftest.report_path("out/r-{rank}.json", two) == Path("out/r-1.json")


@pytest.mark.parametrize("args, says", [(["--checks", "stack,disk"], "expected a comma-separated list"),
                                        (["--backend", "tpu"], "invalid choice"),
                                        (["--shared-dir", "gs://bucket/x"], "found the URL"),
                                        (["--timeout-s", "0"], "expected a positive number of seconds")])
def test_wrong_arguments_exit_2_naming_what_is_wrong(args, says, capsys):
    try:
        code = cli.main(["selftest", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2 and says in capsys.readouterr().err


def test_an_unwritable_temporary_folder_is_a_named_fail_for_each_check(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    found = selftest.run(selftest.Options(tmpdir=str(blocker / "sub")))  # `xlakit selftest` refuses it first
    VALIDATOR.validate(found)
    assert found["status"] == report.FAIL and {c["status"] for c in found["checks"]} == {"fail"}
    assert all(c["reason"].startswith(f"cannot make a temporary folder in {blocker / 'sub'}: NotADirectoryError")
               and "--tmpdir" in c["fix"] for c in found["checks"])


@pytest.mark.parametrize("where, says", [("missing", "no such folder"), ("a-file", "not a folder"),
                                         ("a-file/sub", "no such folder")])
def test_a_tmpdir_that_is_no_folder_is_a_wrong_argument_before_any_check_runs(tmp_path, monkeypatch, capsys, where,
                                                                              says):
    # Regression: `selftest --tmpdir /nonexistent` ran, and reported each check as failed (exit 1).
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setattr(selftest, "run", lambda *a, **kw: pytest.fail("the checks ran"))
    code = cli.main(["selftest", "--json", "--tmpdir", str(tmp_path / where)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"xlakit selftest: --tmpdir {tmp_path / where}: {says}"), err


def test_a_tmpdir_you_cannot_write_in_is_a_wrong_argument(tmp_path):
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    env = {**os.environ, "PYTHONPATH": str(Path(xlakit.__file__).parents[1])}
    run = subprocess.run([*as_a_user(), sys.executable, "-m", "xlakit", "selftest", "--tmpdir", str(readonly)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr == f"xlakit selftest: --tmpdir {readonly}: you cannot write in it; pass a folder you can " \
                         "write, on a local disk (without --tmpdir: TMPDIR, else /tmp)\n"


@pytest.mark.slow
def test_a_rank_whose_peer_never_comes_fails_within_the_deadline_naming_it(tmp_path, monkeypatch):
    from tests.support.ranks import private_port

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(private_port()), "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    found = check_ranks.run({"rank": 0, "world": 2}, quick=True, tmp_base=tmp_path, shared_dir=None,
                            scratch=tmp_path, deadline=time.monotonic() + 20, env=environment.child_env())
    # The rendezvous's own timeout (what is left of the deadline) names the missing rank; on a loaded machine
    # the child's imports can eat that margin, and the deadline stops it first. Either way: named, in time.
    assert found["status"] == "fail" and found["reason"].startswith("rank 0: "), found
    assert ("1/2 clients joined" in found["reason"] or "did not finish within 20 s" in found["reason"]), found
    assert "every rank runs the self-test" in found["fix"] and time.monotonic() - start < 60


def _hanging_torch_xla(tmp_path: Path) -> dict[str, str]:
    """The environment of a stand-in torch_xla whose import never returns (a fake: a real hang is a runtime
    stuck in its plugin); the child writes its pid to tmp_path/pid first."""
    fake = tmp_path / "fake-site" / "torch_xla"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, time\nopen(os.environ['MARK'], 'w').write(str(os.getpid()))\n"
                                      "time.sleep(600)\n")
    return {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO / "python"), str(REPO)]),
            "MARK": str(tmp_path / "pid")}


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (an orphan's, where nothing reaps it)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


@pytest.mark.slow
def test_a_child_that_hangs_is_stopped_at_the_deadline_and_named(tmp_path, monkeypatch):
    for name, value in _hanging_torch_xla(tmp_path).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    out = children.run("stack", {"backend": "torch_xla"}, scratch=tmp_path, deadline=time.monotonic() + 15,
                       env=environment.child_env())
    assert out.timed_out and out.running == "stack" and time.monotonic() - start < 40
    assert out.ended().startswith("did not finish within") and out.ended().endswith("and was stopped")
    assert _gone(int((tmp_path / "pid").read_text()))  # the child is gone, not left running


@pytest.mark.slow
def test_sigterm_from_a_launcher_stops_the_child_and_removes_the_folder(tmp_path):
    # Regression (issue 34, found while building it): the child runs in a session of its own, so a SIGTERM
    # that killed only the self-test would have left it running, holding the device.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, **_hanging_torch_xla(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-m", "xlakit", "selftest", "--checks", "stack"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    child = int((tmp_path / "pid").read_text())
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in out + err, err
    assert _gone(child) and list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_a_child_does_not_outlive_a_self_test_killed_outright(tmp_path):
    # Regression: the child runs in a session of its own, so a SIGKILL of the self-test (a launcher's
    # escalation, the OOM killer, kill -9) left it running on its own, holding the device.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, **_hanging_torch_xla(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-m", "xlakit", "selftest", "--checks", "stack"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    child = int((tmp_path / "pid").read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived the self-test that started it")


@pytest.mark.slow
def test_a_child_that_crashes_is_told_with_its_last_error(tmp_path):
    out = children.run("no-such-job", {}, scratch=tmp_path, deadline=time.monotonic() + 60,
                       env=environment.child_env())
    assert out.returncode == 1 and not out.timed_out and out.ended() == "exited with status 1"
    assert out.last_error() == "KeyError: 'no-such-job'" and out.parts == {}


def test_what_a_stopped_ranks_child_made_is_removed_by_its_parent_and_nothing_else(tmp_path):
    # Regression (issue 34, found while building it): a ranks child SIGKILLed at the deadline or on SIGTERM
    # left its folder in the temporary folder's parent, outside the self-test's own folder.
    ours, theirs = tmp_path / "xlakit-selftest-ranks-abc", tmp_path / "data"
    for folder in (ours, theirs):
        (folder / "sub").mkdir(parents=True)
    (tmp_path / "ranks.out.json").write_text(json.dumps({"parts": {"made": [str(ours), str(theirs)]}}))
    check_ranks._remove_left(tmp_path / "ranks.out.json")
    assert not ours.exists() and (theirs / "sub").is_dir()
    check_ranks._remove_left(tmp_path / "missing.json")  # no outcome: nothing to do, no error
