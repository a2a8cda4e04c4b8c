"""The on-disk kernel cache (numflash/cuda/launch.py) under faults: a damaged entry (truncated
cubin, garbage or old-format metadata, something unreadable in its place) is compiled again with a
warning, never loaded; an unwritable cache directory only costs recompiles; concurrent builders
never see half-written entries. The compiler is replaced by a stand-in, so this runs anywhere."""
import json
import threading
import time
import warnings

import pytest

pytest.importorskip("numba_cuda", reason="the kernel cache belongs to the CUDA path")
from numflash.cuda import launch  # noqa: E402


@pytest.fixture
def compiler(monkeypatch, tmp_path):
    """A stand-in for numba -> PTX -> cubin that counts its calls; the cache in tmp_path."""
    calls = []

    def fake(pyfunc, argtypes, cc, fastmath):
        calls.append(cc)
        time.sleep(0.01)  # long enough for threads to overlap
        return b"\x7fELF-cubin-for-" + bytes(f"{cc}", "ascii") * 100, "entry_fn", "ptx", {}
    monkeypatch.setattr(launch, "compile_to_cubin", fake)
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def kernel():
    return launch.Kernel("test.kernel", lambda **config: None, {"D": 64})


def entry_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache").iterdir())


def test_a_built_kernel_is_read_back_from_disk(compiler, tmp_path):
    first, meta = kernel().build((), (9, 0))
    assert not meta["from_disk"] and len(compiler) == 1
    again, meta2 = kernel().build((), (9, 0))
    assert again == first and meta2["from_disk"] and len(compiler) == 1
    assert meta2["entry"] == "entry_fn" and len(entry_files(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncated cubin", "flipped byte", "garbage metadata",
                                    "metadata without checksum", "metadata not an object"])
def test_a_damaged_entry_is_compiled_again_never_loaded(compiler, tmp_path, damage):
    good, _ = kernel().build((), (8, 0))
    cubin = next((tmp_path / "cache").glob("*.cubin"))
    meta = cubin.with_suffix(".json")
    if damage == "truncated cubin":
        cubin.write_bytes(good[:10])
    elif damage == "flipped byte":
        cubin.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    elif damage == "garbage metadata":
        meta.write_text("{not json")
    elif damage == "metadata without checksum":
        m = json.loads(meta.read_text())
        del m["sha256"]
        meta.write_text(json.dumps(m))
    else:
        meta.write_text("[1, 2]")
    with pytest.warns(RuntimeWarning, match="is damaged.*compiling it again"):
        rebuilt, m = kernel().build((), (8, 0))
    assert rebuilt == good and not m["from_disk"] and len(compiler) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entry is whole again: no warning
        _, m = kernel().build((), (8, 0))
    assert m["from_disk"] and len(compiler) == 2


def test_something_unreadable_in_place_of_an_entry_is_compiled_around(compiler, tmp_path):
    good, _ = kernel().build((), (7, 5))
    cubin = next((tmp_path / "cache").glob("*.cubin"))
    cubin.unlink()
    cubin.mkdir()  # a directory where the cubin should be: reading it fails, so does replacing it
    with pytest.warns(RuntimeWarning) as seen:
        got, meta = kernel().build((), (7, 5))
    assert got == good and not meta["from_disk"]
    said = [str(w.message) for w in seen]
    assert any("cannot be read" in m for m in said)
    assert any("cannot write the kernel cache" in m for m in said)


def test_an_unwritable_cache_directory_only_costs_recompiles(compiler, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr(launch, "_unwritable_warned", set())
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache.*NUMFLASH_CACHE_DIR"):
        got, meta = kernel().build((), (9, 0))
    assert got.startswith(b"\x7fELF") and not meta["from_disk"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per directory and process
        got, meta = kernel().build((), (9, 0))
    assert not meta["from_disk"] and len(compiler) == 2


def test_concurrent_builders_never_see_half_written_entries(compiler, tmp_path):
    results, errors = [], []

    def build():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                results.append(kernel().build((), (9, 0))[0])
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)
    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert len(entry_files(tmp_path)) == 2  # no temporary files left behind
    _, meta = kernel().build((), (9, 0))
    assert meta["from_disk"]
