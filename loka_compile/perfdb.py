"""The kernel performance database: Dispatch's speed-check timings kept across processes.

Timing a site (`speed.site_timing`) costs tens of GEMM runs per candidate provider at every
compile; the timings depend only on the site's shape and recipe and on the machine, so
they are kept in one JSON file, `perfdb.json` under `LOKA_CACHE_DIR` (default:
`$XDG_CACHE_HOME/loka`, else `~/.cache/loka`). An entry's key holds the device's name and
compute capability, the torch and triton versions, loka's timing method, and everything
the timing depends on (the `SiteShape` fields but the device, among them how each operand
is cast, so an A cast with a calibrated static scale never shares an entry with a dynamic
cast; the scaling, the formats, the candidate providers, CUDA graphs or not, fast
accumulation); its value holds the `SiteTiming` fields. A site whose M is symbolic is
keyed by the M it was timed at, the power-of-two bucket of its compile-time size
(`speed.m_bucket`): every batch size of that bucket, and a concrete M of the bucket's
size, reads one entry.

Each insert re-reads the file under a lock, merges and replaces it atomically, so
processes compiling side by side (one per rank) keep each other's entries. A file that
cannot be read is logged and read as empty. A cache directory loka cannot use
(LOKA_CACHE_DIR names a file, or a directory loka may not write: `check_cache_dir`) is
logged once, naming the variable and the path, and the database keeps its entries in
memory: a compile never fails for want of a place to keep timings.

    python -m loka_compile perfdb list     # the entries, as a table
    python -m loka_compile perfdb clear    # delete the file
    python -m loka_compile perfdb path     # where the file is
    (python -m loka_compile.perfdb ... runs the same commands)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch

log = logging.getLogger("loka")

FILE_NAME = "perfdb.json"
# Bump when the file's layout changes: a file of another format is read as empty.
FILE_FORMAT = 1


def cache_dir() -> Path:
    """Where loka keeps its files: LOKA_CACHE_DIR, else the user's cache directory."""
    if os.environ.get("LOKA_CACHE_DIR"):
        return Path(os.environ["LOKA_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "loka"


def _cache_dir_name() -> tuple:
    """(how messages name the cache directory, a hint they end with): the variable that
    set it, or where the default came from."""
    if os.environ.get("LOKA_CACHE_DIR"):
        return f"LOKA_CACHE_DIR={cache_dir()}", ""
    via = "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the home directory"
    return f"the cache directory {cache_dir()} (from {via})", "; set LOKA_CACHE_DIR to a writable directory"


class CacheDirError(ValueError):
    """loka's cache directory cannot hold its files: it is a file, lies under one, or
    cannot be written. The message names the directory and where it came from."""


def check_cache_dir(directory: os.PathLike, name: Optional[str] = None, hint: str = "") -> None:
    """Raise CacheDirError unless `directory` is, or can be made, a directory loka may
    write. `name`: how the message calls it (default: the path); `hint`: its ending."""
    directory = Path(directory)
    name = name or str(directory)
    problem = None
    if directory.exists():
        if not directory.is_dir():
            problem = "is a file, not a directory"
        elif not os.access(directory, os.W_OK | os.X_OK):
            problem = "is not writable"
    else:
        parent = directory.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            problem = f"cannot be made: {parent} is a file, not a directory"
        elif not os.access(parent, os.W_OK | os.X_OK):
            problem = f"cannot be made: {parent} is not writable"
    if problem:
        raise CacheDirError(f"loka: {name} {problem}{hint}")


@functools.lru_cache(maxsize=None)
def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.lru_cache(maxsize=None)
def environment(device: torch.device) -> dict:
    """The machine and software part of a key: timings from another GPU or another torch
    or triton build are not reused."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
    else:
        name, capability = platform.processor() or platform.machine() or device.type, None
    return dict(device_type=device.type, device=name, capability=capability, torch=torch.__version__,
                triton=_triton_version())


def site_key(shape, scaling: str, a_format: str, b_format: str, providers: tuple,
             fast_accum: bool, method: int) -> dict:
    """The key of one site timing: the environment of shape's device, the shape's fields
    (dtype by name; the device index does not change a timing) and the recipe."""
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape) if f.name != "device"}
    fields["dtype"] = str(fields["dtype"]).removeprefix("torch.")
    return dict(environment(shape.device), method=method, **fields, scaling=scaling, a_format=a_format,
                b_format=b_format, providers=list(providers), fast_accum=fast_accum)


def epilogue_key(shape, scaling: str, a_format: str, b_format: str, provider: str, fast_accum: bool,
                 activation: str, residual: bool, out_format: str, norm: Optional[str] = None,
                 write_pre: bool = False, *, method: int) -> dict:
    """The key of one `gemm_epilogue` link timing (`speed.epilogue_timing`): the producing
    site's key with its chosen provider, and what the fused epilogue writes; a chain
    through a norm (gemm_norm) adds the norm and whether the pre-norm value is written."""
    key = dict(site_key(shape, scaling, a_format, b_format, (provider,), fast_accum, method), kind="epilogue",
               activation=activation, residual=residual, out_format=out_format)
    if norm is not None:
        key.update(norm=norm, write_pre=write_pre)
    return key


def _key_id(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


class PerfDB:
    """Timings by key, backed by one JSON file (module docstring)."""

    def __init__(self, path: Optional[os.PathLike] = None, name: Optional[str] = None, hint: str = ""):
        """`path`: the file (default: perfdb.json in `cache_dir()`, named after the variable
        that set it); `name`, `hint`: how messages call its directory (`check_cache_dir`)."""
        if path is None:
            path, (name, hint) = cache_dir() / FILE_NAME, _cache_dir_name()
        self.path = Path(path)
        self.name, self.hint = name or str(self.path.parent), hint
        self._entries: dict = {}      # key id -> {"key": ..., "value": ...}
        self._persist = True          # off once the directory proved unusable or unwritable
        self._checked = False         # the directory checked (`_usable`)

    def check(self) -> None:
        """Raise CacheDirError if the file's directory is unusable (`check_cache_dir`)."""
        check_cache_dir(self.path.parent, self.name, self.hint)

    def _usable(self) -> bool:
        """Whether to use the file; an unusable directory is logged once, and the database
        then keeps its entries in this process alone."""
        if not self._checked:
            self._checked = True
            try:
                self.check()
            except CacheDirError as error:
                self._persist = False
                log.warning("%s; loka cannot write the performance database %s: speed-check timings are kept for "
                            "this process only", error, self.path)
        return self._persist

    def get(self, key: dict) -> Optional[dict]:
        """The stored value of key, or None. A miss re-reads the file: another process may
        have timed the site since."""
        found = self._entries.get(_key_id(key))
        if found is None and self._usable():
            self._entries.update(self._read())
            found = self._entries.get(_key_id(key))
        return None if found is None else found["value"]

    def put(self, key: dict, value: dict) -> None:
        self._entries[_key_id(key)] = {"key": key, "value": value}
        if not self._usable():
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock():
                on_disk = self._read()
                on_disk.update(self._entries)
                self._write(on_disk)
            self._entries = on_disk
        except OSError as error:
            self._persist = False
            log.warning("loka: cannot write the performance database %s (%s); its timings are kept for "
                        "this process only", self.path, error)

    def entries(self) -> list:
        """Every entry, as {"key": ..., "value": ...}."""
        if self._usable():
            self._entries = {**self._read(), **self._entries}
        return list(self._entries.values())

    def clear(self) -> bool:
        """Delete the file and forget the entries; False if there was no file. OSError if
        the file cannot be deleted."""
        self._entries.clear()
        try:
            self.path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _read(self) -> dict:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as error:
            log.warning("loka: cannot read the performance database %s (%s); read as empty", self.path, error)
            return {}
        try:
            data = json.loads(text)
            if data.get("format") != FILE_FORMAT:
                log.warning("loka: performance database %s has format %r, not %d; read as empty and "
                            "replaced at the next insert", self.path, data.get("format"), FILE_FORMAT)
                return {}
            return {_key_id(entry["key"]): {"key": entry["key"], "value": entry["value"]}
                    for entry in data["entries"]}
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning("loka: performance database %s is corrupt (%s: %s); read as empty and replaced at "
                        "the next insert", self.path, type(error).__name__, error)
            return {}

    def _write(self, entries: dict) -> None:
        data = {"format": FILE_FORMAT, "entries": list(entries.values())}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serializes read-merge-write across processes (POSIX; elsewhere the atomic replace
        alone keeps the file whole)."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


_default: Optional[PerfDB] = None


def default_db() -> PerfDB:
    """The database under the current cache directory (follows LOKA_CACHE_DIR changes)."""
    global _default
    path = cache_dir() / FILE_NAME
    if _default is None or _default.path != path:
        _default = PerfDB()
    return _default


def _table(entries: list) -> str:
    """Site timings, then `gemm_epilogue` link timings (fused vs the provider GEMM plus
    Inductor's pointwise kernel) and the graph speed check's verdicts when there are any; a
    line counts entries of another layout."""
    from tabulate import tabulate

    sites, links, graphs, unreadable = [], [], [], 0
    for entry in entries:
        try:
            key, value = entry["key"], entry["value"]
            if key.get("kind") == "graph_speed":  # `graph_speed.verdict_key`: a whole graph's two variants
                graphs.append([key["device"], key["torch"], key["source"][:12], round(value["fp8_ms"], 3),
                               round(value["hp_ms"], 3), value["kept"]])
                continue
            common = [key["device"], key["torch"], f"{key['m']} x {key['k']} x {key['n']}", key["dtype"],
                      key["scaling"], f"{key['a_format']}x{key['b_format']}"]
            if key.get("kind") == "epilogue":
                norm = f" + {key['norm']} norm" + (" (+ pre-norm)" if key["write_pre"] else "") if "norm" in key else ""
                links.append(common + [key["providers"][0], key["activation"]
                                       + (" + residual" if key["residual"] else "") + norm,
                                       round(value["unfused_us"], 1), round(value["fused_us"], 1),
                                       f"{value['unfused_us'] / value['fused_us']:.2f}x"])
            else:
                sites.append(common + [value["provider"], round(value["bf16_us"], 1), round(value["fp8_us"], 1),
                                       f"{value['bf16_us'] / value['fp8_us']:.2f}x"])
        except (KeyError, TypeError, IndexError, ZeroDivisionError):
            unreadable += 1
    head = ["device", "torch", "M x K x N", "dtype", "scaling", "formats"]
    tables = [tabulate(sorted(sites, key=lambda row: row[:3]),
                       headers=head + ["provider", "bf16 us", "fp8 us", "speedup"])] if sites else []
    if links:
        tables.append("gemm_epilogue links:\n" + tabulate(
            sorted(links, key=lambda row: row[:3]),
            headers=head + ["unfused provider", "epilogue", "unfused us", "fused us", "speedup"]))
    if graphs:
        tables.append("graph speed verdicts:\n" + tabulate(
            sorted(graphs), headers=["device", "torch", "graph", "FP8 ms", "high precision ms", "kept"]))
    if unreadable:
        tables.append(f"{unreadable} entries of another layout not shown")
    return "\n\n".join(tables)


COMMANDS = ("list", "clear", "path")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The database commands' arguments (this module's CLI and `python -m loka_compile perfdb`)."""
    parser.add_argument("command", choices=COMMANDS,
                        help="list: the entries as a table; clear: delete the file; path: where it is")
    parser.add_argument("--cache-dir", help="the cache directory (default: LOKA_CACHE_DIR, else the user's "
                                            "cache directory)")


def run(args: argparse.Namespace) -> int:
    """Run one database command; an unusable cache directory or a file that cannot be
    deleted prints one line to stderr and returns 2."""
    if args.cache_dir:
        directory = Path(args.cache_dir).expanduser()
        db = PerfDB(directory / FILE_NAME, name=f"--cache-dir {directory}")
    else:
        db = PerfDB()
    try:
        db.check()
        if args.command == "path":
            print(db.path)
        elif args.command == "clear":
            removed = len(db.entries())
            print(f"deleted {db.path} ({removed} entries)" if db.clear() else f"no database at {db.path}")
        else:
            entries = db.entries()
            if entries:
                print(_table(entries))
            print(f"{len(entries)} entries in {db.path}")
    except CacheDirError as error:
        print(error, file=sys.stderr)
        return 2
    except OSError as error:
        print(f"loka: performance database {db.path}: {error.strerror or error}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loka_compile.perfdb",
                                     description="loka's kernel performance database (speed-check timings); "
                                                 "also `python -m loka_compile perfdb`")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
