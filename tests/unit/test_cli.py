"""The command line, `python -m loka_compile`: report a saved plan, diff two plans, the
performance database; damaged plans and an unusable cache directory as one-line errors
(exit 2), and `load_plan` checking every field of a plan."""

import copy
import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch

import loka_compile
from loka_compile import cli, perfdb, speed
from loka_compile.plan import SitePlan
from test_plan import TENSORWISE_PROBE, Tower, outlier_batch, step

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    """The saved plan of a Tower compiled with `torch.compile(backend="loka")` and trained
    through its probe window (as tests/unit/test_plan.py makes one), made once for the module."""
    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(Tower(), backend="loka", options=TENSORWISE_PROBE)
    x = outlier_batch()
    step(compiled, x)
    step(compiled, x)
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    loka_compile.save_plan(compiled, path)
    return path


SITE = "forward/fc2:fwd#1"


def run(capsys, *argv):
    """(exit status, stdout, stderr) of the CLI run in this process."""
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def edited(plan_path, tmp_path, edit, name="edited.json"):
    """A copy of the saved plan, `edit(data)` applied to its JSON."""
    data = json.loads(plan_path.read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "loka_compile", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "report" in done.stdout and "plan" in done.stdout and "perfdb" in done.stdout


# -- report ----------------------------------------------------------------------------

def test_report_prints_the_summary_and_every_site(plan_path, capsys):
    status, out, err = run(capsys, "report", plan_path)
    assert status == 0 and not err
    plan = loka_compile.load_plan(plan_path)
    assert out.startswith(f"loka plan {plan_path}: recipe tensorwise, device type cpu")
    assert f"{len(plan.sites)} GEMM sites, {sum(e.fp8 for e in plan.sites.values())} in FP8" in out
    assert "probe verdicts:" in out and "forward/fc1:fwd#1 -> rowwise" in out  # the outlier's upgrade
    table = out.split("\n\n", 1)[1]
    assert "site id" in table and "reason" in table
    for sid, entry in plan.sites.items():
        (row,) = [line for line in table.splitlines() if f" {sid} " in line]
        assert entry.reason in row and ("yes" if entry.fp8 else "no") in row.split()


# -- plan diff -------------------------------------------------------------------------

def test_diff_of_a_plan_with_itself_exits_0(plan_path, capsys):
    status, out, err = run(capsys, "plan", "diff", plan_path, plan_path)
    assert status == 0 and "same decisions" in out and not err


def test_diff_lists_each_change_and_exits_1(plan_path, tmp_path, capsys):
    def edit(data):
        data["recipe"] = "rowwise"
        data["sites"][SITE].update(scaling="rowwise", provider="triton")
        data["sites"]["forward/fc3:fwd#1"] = data["sites"].pop("backward/fc2:dgrad#1")
        data["a_scales"] = {SITE: {"scale": 0.5, "range": 224.0, "policy": "amax", "error": 0.01}}
        data["sites"]["forward/fc1:fwd#1"]["detail"] = "another run's timings"  # not a decision: not listed

    status, out, err = run(capsys, "plan", "diff", plan_path, edited(plan_path, tmp_path, edit))
    assert status == 1 and not err
    rows = [line.split() for line in out.splitlines()[3:]]
    assert ["plan", "recipe", "tensorwise", "rowwise"] in rows
    assert [SITE, "scaling", "tensorwise", "rowwise"] in rows and [SITE, "provider", "emulated", "triton"] in rows
    assert [SITE, "static", "scale", "-", "0.5"] in rows
    assert ["backward/fc2:dgrad#1", "site", "fp8", "tensorwise", "e5m2", "x", "e4m3", "on", "emulated", "-"] in rows
    assert rows[-1][:2] == ["forward/fc3:fwd#1", "site"] and rows[-1][2] == "-"
    assert "1 site(s) only in A, 1 only in B" in out
    assert not any("forward/fc1:fwd#1" in row for row in rows)


# -- damaged plans: one line, exit 2; load_plan raises ValueError --------------------------

def _set(field, value):
    def edit(data):
        data["sites"][SITE][field] = value
    return edit


def _drop(field):
    def edit(data):
        del data["sites"][SITE][field]
    return edit


DAMAGED = {
    "invalid scaling": (_set("scaling", "columnwise"),
                        f"site '{SITE}': scaling must be '' or one of 'tensorwise', 'rowwise', 'blockwise', "
                        "not 'columnwise'"),
    "invalid format": (_set("a_format", "e3m4"), f"site '{SITE}': a_format must be '' or one of 'e4m3', 'e5m2', "
                                                 "not 'e3m4'"),
    "invalid reason": (_set("reason", "too_fast"), f"site '{SITE}': reason must be one of 'fp8', "),
    "fp8 as a string": (_set("fp8", "no"), f"site '{SITE}': fp8 must be true or false, not 'no'"),
    "missing field": (_drop("fp8"), f"site '{SITE}': fp8 is missing"),
    "pad as a float": (_set("pad_k", 1.5), f"site '{SITE}': pad_k must be a non-negative integer, not 1.5"),
    "fp8 without the fp8 reason": (_set("reason", "too_small"), f"site '{SITE}': fp8 is true with reason 'too_small'"),
    "bad candidate": (_set("candidates", [{"provider": "emulated", "gemm_us": "fast", "chosen": True}]),
                      f"site '{SITE}': candidates[0].gemm_us must be null or a non-negative number"),
    "invalid recipe": (lambda data: data.update(recipe="fp4"), "recipe must be one of "),
    "invalid device type": (lambda data: data.update(device_type="gpu"), "device_type must be a torch device type"),
    "bad parameter": (lambda data: data["params"].update({"fc1.weight": [[64, 32], "float33"]}),
                      "parameter 'fc1.weight': must be [shape, dtype]"),
    "bad static scale": (lambda data: data.update(a_scales={SITE: {"scale": -1.0, "range": 1.0, "policy": "amax",
                                                                    "error": 0.0}}),
                         f"a_scales '{SITE}': scale -1.0 is not finite and positive"),
    "bad upgrade": (lambda data: data["upgraded"].update({SITE: ["sideways", []]}), f"upgraded '{SITE}': must be "),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_plan_is_one_line_and_exit_2(plan_path, tmp_path, capsys, case):
    edit, message = DAMAGED[case]
    path = edited(plan_path, tmp_path, edit)
    with pytest.raises(ValueError) as caught:
        loka_compile.load_plan(path)
    assert str(caught.value).startswith(f"loka plan {path} is damaged: ") and message in str(caught.value)
    for argv in (["report", path], ["plan", "diff", plan_path, path]):
        status, out, err = run(capsys, *argv)
        assert status == 2 and not out
        assert err == f"{caught.value}\n" and "Traceback" not in err


def test_damaged_plan_is_refused_by_the_plan_option(plan_path, tmp_path):
    """Through `options={"plan": ...}` too: the compile raises, naming the site and field,
    rather than every graph falling back to high precision."""
    path = edited(plan_path, tmp_path, _set("scaling", "columnwise"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=f"site '{SITE}': scaling must be") as caught:
        torch.compile(Tower(), backend="loka", options={**TENSORWISE_PROBE, "plan": str(path)})(outlier_batch())
    assert isinstance(caught.value.inner_exception, ValueError)


def test_every_site_field_is_checked_and_a_saved_plan_round_trips(plan_path):
    from loka_compile.plan import _SITE_FIELDS

    assert set(_SITE_FIELDS) == {f.name for f in dataclasses.fields(SitePlan)}
    plan = loka_compile.load_plan(plan_path)
    assert loka_compile.Plan.from_json(copy.deepcopy(plan.to_json())).to_json() == plan.to_json()


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"), ("{not json", "is not JSON"), (b"\xff\xfe\x00", "is not JSON: not UTF-8 text"),
    ("[1, 2]", "format version 'list'"),
])
def test_missing_or_non_json_plan_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "p.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    status, out, err = run(capsys, "report", path)
    assert status == 2 and not out and err.count("\n") == 1 and message in err and str(path) in err


# -- perfdb ---------------------------------------------------------------------------

def _timing_entry(db):
    shape = speed.SiteShape(32, 64, 32, "row", "column", True, torch.bfloat16, torch.device("cpu"))
    key = perfdb.site_key(shape, "rowwise", "e4m3", "e4m3", ("emulated",), False, method=speed.TIMING_METHOD)
    db.put(key, dict(bf16_us=10.0, fp8_us=8.0, provider="emulated", gemm_us={"emulated": 7.0}, cast_us=1.0))


def test_perfdb_list_clear_path(cache_dir, capsys):
    path = cache_dir / perfdb.FILE_NAME
    assert run(capsys, "perfdb", "path") == (0, f"{path}\n", "")
    _timing_entry(perfdb.PerfDB(path))
    status, out, _ = run(capsys, "perfdb", "list")
    assert status == 0 and "32 x 64 x 32" in out and "emulated" in out and "1.25x" in out
    assert out.splitlines()[-1] == f"1 entries in {path}"
    assert run(capsys, "perfdb", "clear") == (0, f"deleted {path} (1 entries)\n", "") and not path.exists()
    assert run(capsys, "perfdb", "clear")[1] == f"no database at {path}\n"


@pytest.mark.parametrize("command", ["list", "clear", "path"])
def test_cache_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, command):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setenv("LOKA_CACHE_DIR", str(a_file))
    status, out, err = run(capsys, "perfdb", command)
    assert (status, out) == (2, "")
    assert err == f"loka: LOKA_CACHE_DIR={a_file} is a file, not a directory\n"
    monkeypatch.setenv("LOKA_CACHE_DIR", str(a_file / "loka"))
    assert run(capsys, "perfdb", command)[2] == (f"loka: LOKA_CACHE_DIR={a_file / 'loka'} cannot be made: "
                                                 f"{a_file} is a file, not a directory\n")
    with pytest.raises(perfdb.CacheDirError):
        perfdb.PerfDB().check()


def test_cache_dir_that_is_a_file_does_not_fail_a_compile(fp8_hardware, tmp_path, monkeypatch, caplog):
    """The speed check runs (FP8 hardware stood in for, its timings faked) with LOKA_CACHE_DIR
    naming a file: the compile logs one warning naming the variable and the path, keeps
    its timings in memory and runs FP8."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setenv("LOKA_CACHE_DIR", str(a_file))
    timed = []

    def measure(shape, scaling, a_format, b_format, providers, fast_accum):
        timed.append(shape)
        return speed.SiteTiming(10.0, 5.0, providers[0], {providers[0]: 4.0}, 1.0)

    monkeypatch.setattr(speed, "_measure_site", measure)
    speed.clear_cache()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
        compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
        x = torch.randn(32, 64)
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
            out = compiled(x)
    finally:
        speed.clear_cache()
    assert torch.allclose(out, model(x), rtol=0.1, atol=0.1)
    sites = loka_compile.report(compiled).sites
    assert timed and all(s.fp8 and s.fp8_us == 5.0 for s in sites)
    warnings = [r.getMessage() for r in caplog.records if "LOKA_CACHE_DIR" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"loka: LOKA_CACHE_DIR={a_file} is a file, not a directory; ")
    assert "Traceback" not in caplog.text and a_file.read_text() == ""
