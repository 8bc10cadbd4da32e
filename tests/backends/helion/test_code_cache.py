"""The helion backend's code cache (`kda/backends/helion/code_cache.py`): what enters an entry's key, a saved
module loaded back, and every damaged or hostile entry ignored with one warning and replaced.

The compiled kernels' own round trip through the cache (a later process runs every kernel from it, Helion's
compiler unused) is in `test_helion_compiled.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("triton", reason="the code cache keys on Triton's version (extra `triton`)")

from kda.backends.helion import code_cache, runtime
from kda.backends.helion.configs import ShapeKey

MODULE = "def scale_kernel(x, factor):\n    x.mul_(factor)\n"


def state_kernel():  # stands for a Helion kernel function: the launch key names it by module and name
    pass


def key_for(T: int = 200, K: int = 64, tables: str = "t1", device: str = "cpu", precision: str = "tf32") -> str:
    args = (torch.empty(T, 4, K), torch.empty(3, dtype=torch.int32), 64, True)
    launch = runtime.launch_key(state_kernel, precision, args, ShapeKey("sm90", K, 64, 64, True))
    return code_cache.entry_key(launch, tables, torch.device(device))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_cache, "_WARNED", set())
    return tmp_path / "kda-helion"


def test_the_key_follows_what_decides_the_code_and_not_the_sequence_length(monkeypatch):
    base = key_for()
    assert key_for(T=999) == base  # a new length or batch is the same code, as in one process
    assert key_for(T=1) != base  # a size of 1 is specialized by Helion, and so by the key
    assert key_for(K=128) != base
    assert key_for(tables="t2") != base  # another configuration table
    assert key_for(precision="tf32x3") != base
    assert key_for(device="meta") != base
    monkeypatch.setenv("HELION_INDEX_DTYPE", "torch.int64")  # Helion's settings come from its environment
    assert key_for() != base


def test_the_key_follows_the_backends_sources(monkeypatch):
    base = key_for()
    monkeypatch.setattr(code_cache, "_sources_digest", lambda: "another kernel")
    assert key_for() != base


def test_a_saved_module_loads_and_runs_with_its_default_warning(cache):
    code_cache.save("k1", "scale_kernel", MODULE, "no table entry at K=64")
    run, default = code_cache.load("k1", "scale_kernel")
    x = torch.ones(3)
    run(x, 2.5)
    assert torch.equal(x, torch.full((3,), 2.5))
    assert default == "no table entry at K=64"
    assert code_cache.load("absent", "scale_kernel") is None  # a miss says nothing


def test_only_cuda_launches_use_it_and_the_switch_turns_it_off(monkeypatch):
    assert code_cache.enabled(torch.device("cuda", 0))
    assert not code_cache.enabled(torch.device("cpu"))
    monkeypatch.setenv(code_cache.SWITCH_ENV, "0")
    assert not code_cache.enabled(torch.device("cuda", 0))


def entry(code: str = MODULE, **changes) -> str:
    """An entry's text: a whole one for `code`, with `changes` over its fields."""
    fields = dict(format=code_cache.FORMAT, kernel="scale_kernel", default=None, code=code)
    fields["sha256"] = hashlib.sha256(code.encode()).hexdigest()
    fields.update(changes)
    return json.dumps(fields)


RAISES = "raise RuntimeError('boom')\n"


HOSTILE = {
    "not JSON": lambda path: path.write_bytes(b"\x00\xff garbage"),
    "a JSON list": lambda path: path.write_text("[1, 2]"),
    "nested too deep": lambda path: path.write_text("[" * 100_000 + "]" * 100_000),
    "another format": lambda path: path.write_text(entry(format=99)),
    "a digest that does not match": lambda path: path.write_text(entry(sha256=hashlib.sha256(b"other").hexdigest())),
    "another kernel": lambda path: path.write_text(entry(kernel="other_kernel")),
    "a default that is not text": lambda path: path.write_text(entry(default=[1])),
    "a module that does not import": lambda path: path.write_text(entry(RAISES)),
    "too large": lambda path: path.write_bytes(b" " * (code_cache.MAX_ENTRY_BYTES + 1)),
    "a directory": lambda path: path.mkdir(),
    "a FIFO": lambda path: os.mkfifo(path),
}


@pytest.mark.parametrize("damage", list(HOSTILE), ids=list(HOSTILE))
def test_a_damaged_or_hostile_entry_is_ignored_once_with_a_warning_and_replaced(cache, damage):
    cache.mkdir(parents=True)
    path = cache / "k1.json"
    HOSTILE[damage](path)
    with pytest.warns(UserWarning, match="ignoring the helion code cache entry .*k1.json") as seen:
        assert code_cache.load("k1", "scale_kernel") is None
        assert code_cache.load("k1", "scale_kernel") is None  # once per file and process
    assert len(seen) == 1
    if path.is_dir() or not path.is_file():  # not ours to replace: the next compile keeps working
        return
    code_cache.save("k1", "scale_kernel", MODULE, None)
    run, _ = code_cache.load("k1", "scale_kernel")
    x = torch.ones(2)
    run(x, 3.0)
    assert torch.equal(x, torch.full((2,), 3.0))


def test_a_cache_that_cannot_be_written_warns_once_and_never_raises(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_cache, "directory", lambda: blocker / "kda-helion")
    monkeypatch.setattr(code_cache, "_WARNED", set())
    with pytest.warns(UserWarning, match="cannot be written") as seen:
        code_cache.save("k1", "scale_kernel", MODULE, None)
        code_cache.save("k2", "scale_kernel", MODULE, None)
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert code_cache.load("k1", "scale_kernel") is None  # nothing there: a quiet miss
