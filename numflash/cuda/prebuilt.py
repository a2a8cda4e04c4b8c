"""PTX shipped inside the package for the common configurations, so that their first call links
it (nvJitLink/ptxas, about a second) instead of compiling the Python source (numba typing and
lowering plus NVVM: 5-60 s, 95% of a cold first call, bench/RESULTS.md).

Each file is one kernel variant's PTX, xz-compressed, under ptx/, named by its key
(launch.Kernel.prebuilt_key: kernel name, config, argument types, and the digest of its code: the
kernel module's source and the numflash.cuda modules it imports, or for a generated kernel the
source it generates; with launch.compile_ptx either way) and the architecture it was
generated for; ptx/manifest.json lists them. After an edit of a kernel's sources its key no
longer matches, so its shipped file is not used (it compiles from source as before), and
tests/test_precompile.py fails until ``python -m numflash.precompile --ship`` has made the
stale files again (only those). NUMFLASH_PREBUILT=0 ignores them
(to time or debug a compile from source).
"""
import json
import lzma
import os
import pathlib
import threading
import warnings

DIR = pathlib.Path(__file__).parent / "ptx"
MANIFEST = DIR / "manifest.json"

_manifest = None
_lock = threading.Lock()
_link_failed = []


def manifest():
    """The shipped manifest ({"entries": {key: {"about", "ccs", "numba_cuda"}}}), or an empty
    one if none is shipped."""
    global _manifest
    if _manifest is None:
        with _lock:
            try:
                _manifest = json.loads(MANIFEST.read_text())
            except (OSError, ValueError):
                _manifest = {"entries": {}}
    return _manifest


def file_name(key, cc):
    return f"{key}-sm{cc[0]}{cc[1]}.ptx.xz"


def find(key, cc):
    """The shipped PTX file for this variant that a device of compute capability ``cc`` can use
    (PTX for an older architecture is forward compatible; the newest one not above ``cc``), or
    None."""
    entry = manifest()["entries"].get(key)
    if entry is None or _link_failed or os.environ.get("NUMFLASH_PREBUILT", "1") == "0":
        return None
    usable = [tuple(c) for c in entry["ccs"] if tuple(c) <= tuple(cc)]
    if not usable:
        return None
    path = DIR / file_name(key, max(usable))
    return path if path.exists() else None


def link(key, cc):
    """(cubin, entry, resources) linked from the shipped PTX for this variant, or None if none
    is shipped or it cannot be linked here (an nvJitLink older than the PTX: warned once, and
    the variant is compiled from source as if nothing were shipped)."""
    path = find(key, cc)
    if path is None:
        return None
    from .launch import link_ptx
    try:
        return link_ptx(lzma.decompress(path.read_bytes()).decode(), cc)
    except Exception as e:  # noqa: BLE001 - any failure only costs the compile from source
        _link_failed.append(str(e))
        warnings.warn(f"numflash: the shipped PTX cannot be linked here ({type(e).__name__}: "
                      f"{str(e)[:200]}); kernels compile from source on their first use "
                      f"instead (5-60 s each)", RuntimeWarning, stacklevel=4)
        return None


#: PTX ISA versions tried, oldest first, when shipping: 7.0 came with CUDA 11.0 (sm_80), 7.8
#: with CUDA 11.8 (sm_90), 8.0 with CUDA 12.0.
ISA_VERSIONS = ("7.0", "7.8", "8.0", "8.3", "8.5", "8.7")


def portable(ptx, cc):
    """The PTX with the oldest ``.version`` header that links to the very same cubin, so that an
    older nvJitLink than the one that generated it (NVVM of CUDA 13.5 writes 9.5; the cuda12
    extra brings a CUDA 12 nvJitLink) can take it; unchanged if no older version gives the same
    bytes."""
    import re
    from .launch import link_ptx
    reference = link_ptx(ptx, cc)[0]
    for version in ISA_VERSIONS:
        older = re.sub(r"^\.version \d+\.\d+", f".version {version}", ptx, count=1, flags=re.M)
        try:
            if link_ptx(older, cc)[0] == reference:
                return older
        except Exception:  # noqa: BLE001 - this version cannot express it: try a newer one
            continue
    return ptx


def write(made, keep, numba_cuda_version):
    """Make the shipped set: ``made``, (key, cc, ptx text, description) tuples, are written;
    ``keep``, (key, cc) pairs already shipped, stay; every other file goes."""
    DIR.mkdir(exist_ok=True)
    old = manifest()["entries"]
    entries = {}
    for key, cc in keep:
        entry = entries.setdefault(key, {"about": old[key]["about"], "ccs": [],
                                         "numba_cuda": old[key].get("numba_cuda", "?")})
        entry["ccs"] = sorted(set(map(tuple, entry["ccs"])) | {tuple(cc)})
    for key, cc, ptx, about in made:
        (DIR / file_name(key, cc)).write_bytes(lzma.compress(ptx.encode(), preset=9))
        entry = entries.setdefault(key, {"about": about, "ccs": [],
                                         "numba_cuda": numba_cuda_version})
        entry["ccs"] = sorted(set(map(tuple, entry["ccs"])) | {tuple(cc)})
    wanted = {file_name(key, cc) for key, e in entries.items() for cc in e["ccs"]}
    for path in DIR.glob("*.ptx.xz"):
        if path.name not in wanted:
            path.unlink()
    MANIFEST.write_text(json.dumps({"entries": entries}, indent=1, sort_keys=True) + "\n")
    global _manifest
    _manifest = None
