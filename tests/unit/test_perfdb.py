"""The kernel performance database: persistence, keys, damaged files, the CLI, and
speed.site_timing reusing a timing another process stored."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from loka_compile import perfdb, speed

RECIPE = dict(scaling="rowwise", a_format="e4m3", b_format="e4m3", providers=("emulated",),
              fast_accum=False)


@pytest.fixture
def shape():
    return speed.SiteShape(32, 64, 32, "row", "column", True, torch.bfloat16, torch.device("cpu"))


@pytest.fixture
def key(shape):
    return perfdb.site_key(shape, **RECIPE, method=speed.TIMING_METHOD)


def _value(bf16_us=10.0, fp8_us=8.0):
    return dict(bf16_us=bf16_us, fp8_us=fp8_us, provider="emulated", gemm_us={"emulated": fp8_us - 1.0},
                cast_us=1.0, bf16_range_us=[9.0, 11.0], fp8_range_us=[7.5, 9.0])


class TestStore:
    def test_round_trip_across_instances(self, tmp_path, key):
        path = tmp_path / perfdb.FILE_NAME
        perfdb.PerfDB(path).put(key, _value())
        assert perfdb.PerfDB(path).get(key) == _value()

    def test_two_writers_keep_each_others_entries(self, tmp_path, key):
        path = tmp_path / perfdb.FILE_NAME
        first, second = perfdb.PerfDB(path), perfdb.PerfDB(path)
        other = dict(key, m=64)
        first.put(key, _value())
        second.put(other, _value(20.0))
        stored = perfdb.PerfDB(path)
        assert stored.get(key) == _value() and stored.get(other) == _value(20.0)
        assert len(stored.entries()) == 2
        assert first.get(other) == _value(20.0)  # a miss re-reads the file

    def test_key_holds_environment_and_site(self, shape, key):
        assert key["torch"] == torch.__version__ and key["device_type"] == "cpu" and key["capability"] is None
        assert (key["m"], key["k"], key["n"], key["dtype"]) == (32, 64, 32, "bfloat16")
        assert "triton" in key and key["providers"] == ["emulated"]
        cached_b = perfdb.site_key(dataclasses.replace(shape, b_cached=True), **RECIPE, method=speed.TIMING_METHOD)
        assert cached_b != key
        # a static-scale A and a dynamic one are timed apart
        static_a = perfdb.site_key(dataclasses.replace(shape, a_static=True), **RECIPE, method=speed.TIMING_METHOD)
        assert static_a["a_static"] and not key["a_static"] and static_a != key

    @pytest.mark.parametrize("field, other", [("torch", "2.99.0"), ("device", "NVIDIA H200"),
                                              ("capability", "9.0"), ("triton", None)])
    def test_another_environment_misses(self, tmp_path, key, field, other):
        db = perfdb.PerfDB(tmp_path / perfdb.FILE_NAME)
        db.put(key, _value())
        assert key[field] != other
        assert perfdb.PerfDB(db.path).get(dict(key, **{field: other})) is None

    @pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"format": 1, "entries": [{"key": 1}]}',
                                      '{"format": 99, "entries": []}'])
    def test_damaged_file_reads_as_empty_and_is_replaced(self, tmp_path, key, caplog, text):
        path = tmp_path / perfdb.FILE_NAME
        path.write_text(text)
        db = perfdb.PerfDB(path)
        with caplog.at_level("WARNING", logger="loka"):
            assert db.get(key) is None
        assert "performance database" in caplog.text
        db.put(key, _value())
        assert perfdb.PerfDB(path).get(key) == _value()
        assert json.loads(path.read_text())["format"] == perfdb.FILE_FORMAT

    def test_unwritable_directory_warns_once_and_keeps_entries_in_memory(self, tmp_path, key, caplog):
        (tmp_path / "a_file").write_text("")
        db = perfdb.PerfDB(tmp_path / "a_file" / "loka" / perfdb.FILE_NAME)  # its parent cannot be made
        with caplog.at_level("WARNING", logger="loka"):
            db.put(key, _value())
            db.put(dict(key, m=64), _value(20.0))
        assert caplog.text.count("cannot write the performance database") == 1
        assert db.get(key) == _value() and db.get(dict(key, m=64)) == _value(20.0)

    def test_no_temporary_files_left(self, tmp_path, key):
        perfdb.PerfDB(tmp_path / perfdb.FILE_NAME).put(key, _value())
        assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]

    def test_cache_dir_defaults(self, monkeypatch, tmp_path):
        monkeypatch.delenv("LOKA_CACHE_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert perfdb.cache_dir() == tmp_path / "loka"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path))
        assert perfdb.cache_dir() == tmp_path / ".cache" / "loka"
        monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path / "mine"))
        assert perfdb.default_db().path == tmp_path / "mine" / perfdb.FILE_NAME


class TestCli:
    def _run(self, *args, cache_dir):
        env = dict(os.environ, LOKA_CACHE_DIR=str(cache_dir))
        done = subprocess.run([sys.executable, "-m", "loka_compile.perfdb", *args], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "RuntimeWarning" not in done.stderr
        return done.stdout

    def test_list_then_clear(self, tmp_path, key):
        path = tmp_path / perfdb.FILE_NAME
        perfdb.PerfDB(path).put(key, _value())
        verdict = dict(perfdb.environment(torch.device("cpu")), kind="graph_speed", source="ab12" * 16)
        perfdb.PerfDB(path).put(verdict, {"fp8_ms": 1.5, "hp_ms": 1.25, "kept": "high precision"})
        listed = self._run("list", cache_dir=tmp_path)
        assert "32 x 64 x 32" in listed and "emulated" in listed and "1.25x" in listed
        assert "graph speed verdicts:" in listed and "ab12ab12ab12" in listed and "high precision" in listed
        assert "2 entries in" in listed and "another layout" not in listed
        assert torch.__version__ in listed and str(path) in listed
        cleared = self._run("clear", cache_dir=tmp_path)
        assert f"deleted {path}" in cleared and not path.exists()

    def test_path_and_cache_dir_option(self, tmp_path, capsys, cache_dir):
        assert perfdb.main(["path"]) == 0
        assert capsys.readouterr().out.strip() == str(cache_dir / perfdb.FILE_NAME)
        other = tmp_path / "other"
        perfdb.main(["path", "--cache-dir", str(other)])
        assert capsys.readouterr().out.strip() == str(other / perfdb.FILE_NAME)
        perfdb.main(["clear", "--cache-dir", str(other)])
        assert "no database at" in capsys.readouterr().out
        perfdb.main(["list", "--cache-dir", str(other)])
        assert "0 entries" in capsys.readouterr().out


class TestSiteTiming:
    @pytest.fixture
    def measured(self, monkeypatch, cache_dir):
        """Counts the sites speed actually times; starts with a cold process cache."""
        calls = []
        measure = speed._measure_site

        def counting(*args):
            calls.append(args)
            return measure(*args)

        monkeypatch.setattr(speed, "_measure_site", counting)
        speed.clear_cache()
        yield calls
        speed.clear_cache()

    def test_second_process_times_nothing(self, shape, measured, cache_dir, monkeypatch):
        timing = speed.site_timing(shape, **RECIPE)
        assert len(measured) == 1 and timing.provider == "emulated"
        lo, hi = timing.bf16_range_us
        assert lo <= timing.bf16_us <= hi and timing.fp8_range_us[0] <= timing.fp8_us <= timing.fp8_range_us[1]
        (entry,) = perfdb.PerfDB(cache_dir / perfdb.FILE_NAME).entries()
        assert entry["key"]["m"] == 32 and entry["value"]["bf16_us"] == timing.bf16_us

        speed.clear_cache()  # the process cache forgets; the database instance still holds it
        assert speed.site_timing(shape, **RECIPE) == timing and len(measured) == 1

        speed.clear_cache()
        monkeypatch.setattr(perfdb, "_default", None)  # a fresh process: the database read from disk
        again = speed.site_timing(shape, **RECIPE)
        assert again == timing and isinstance(again.fp8_range_us, tuple) and len(measured) == 1
        assert speed.site_timing(shape, **RECIPE) is again  # and the process cache holds it

    def test_other_recipe_is_timed(self, shape, measured, cache_dir):
        speed.site_timing(shape, **RECIPE)
        speed.site_timing(shape, **dict(RECIPE, fast_accum=True))
        assert len(measured) == 2

    def test_unwritable_cache_still_times_once(self, shape, measured, tmp_path, monkeypatch):
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path / "a_file"))
        timing = speed.site_timing(shape, **RECIPE)
        speed.clear_cache()
        assert speed.site_timing(shape, **RECIPE) == timing and len(measured) == 1


class TestSymbolicBatch:
    """A dynamic=True model on CPU with FP8 hardware stood in for (the emulated provider,
    marked as hardware) and its timings faked: each symbolic-M site is timed at the bucket
    of the example batch, stored under that bucket, and a later process reuses it."""

    BATCH, BUCKET = 48, 64

    @pytest.fixture
    def fp8_machine(self, fp8_hardware, monkeypatch, cache_dir, fresh_compile_state):
        timed = []

        def measure(shape, scaling, a_format, b_format, providers, fast_accum):
            # FP8 pays on the wide layer (N = 128), not on the narrow one
            timed.append(shape)
            fp8_us = 5.0 if shape.n == 128 else 20.0
            return speed.SiteTiming(10.0, fp8_us, providers[0], {providers[0]: fp8_us - 1.0}, 1.0)

        monkeypatch.setattr(speed, "_measure_site", measure)
        speed.clear_cache()
        yield timed
        speed.clear_cache()

    @staticmethod
    def _compile_and_run(batch):
        import loka_compile

        torch._dynamo.reset()
        loka_compile.reset()
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
        compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0, "recipe": "rowwise"})
        with torch.no_grad():
            # the graph serves a batch far from the bucket too, with the bucket's decisions
            for rows in (batch, 300):
                x = torch.randn(rows, 64)
                assert torch.allclose(compiled(x), model(x), rtol=0.1, atol=0.1)
        report = loka_compile.report(compiled)
        assert len(report.graphs) == 1
        return report

    def test_timed_at_the_bucket_stored_and_reused(self, fp8_machine, cache_dir, monkeypatch):
        report = self._compile_and_run(self.BATCH)
        sites = {s.shape[2]: s for s in report.sites}
        assert all(isinstance(s.shape[0], str) for s in report.sites)  # M is symbolic
        assert sorted((shape.m, shape.k, shape.n) for shape in fp8_machine) == [(64, 64, 128), (64, 128, 32)]
        assert sites[128].fp8 and sites[128].reason == "fp8"
        assert not sites[32].fp8 and sites[32].reason == "slower_than_bf16"
        for site in report.sites:
            assert site.m_bucket == self.BUCKET
            assert f"timed at {self.BUCKET}, the power of two at or above its compile-time size {self.BATCH}" \
                in site.detail
        assert "(timed M=64)" in report.table()
        stored = perfdb.PerfDB(cache_dir / perfdb.FILE_NAME).entries()
        assert sorted((e["key"]["m"], e["key"]["n"]) for e in stored) == [(64, 32), (64, 128)]

        # A fresh process compiling at another batch of the same bucket times nothing.
        speed.clear_cache()
        monkeypatch.setattr(perfdb, "_default", None)
        again = self._compile_and_run(40)
        assert len(fp8_machine) == 2
        assert [(s.fp8, s.reason, s.m_bucket) for s in again.sites] == \
            [(s.fp8, s.reason, s.m_bucket) for s in report.sites]
