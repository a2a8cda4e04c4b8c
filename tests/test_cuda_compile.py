"""Every CUDA kernel variant compiles, with no GPU, to PTX and to a cubin for sm_75, sm_80 and
sm_90 (numba -> NVVM -> nvJitLink, which runs ptxas), and no default config spills.

numba's simulator replaces numba.cuda in this process (tests/conftest.py), so compilation runs in a
subprocess with the simulator off.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ARCHS = "75,80,90"


def run_without_simulator(code):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def report():
    """ptxas' report for every kernel's default config at each size, dtype and architecture
    (d = 96 is where cuda.row splits the output columns with q held, d >= 128 where q moves to
    shared memory; d = 64 left out for CI time)."""
    out = run_without_simulator(f"""
        import io, json
        from numflash.inspect import inspect
        archs = [(int(a[0]), int(a[1:])) for a in "{ARCHS}".split(",")]
        rows = inspect(archs, head_dims=(1, 59, 96, 128, 256), out=io.StringIO())
        print(json.dumps([dict(r, cc=list(r["cc"])) for r in rows]))
    """)
    return json.loads(out.splitlines()[-1])


def test_every_variant_compiles_for_every_arch(report):
    compiled = [r for r in report if "config" in r]
    for cc in ([7, 5], [8, 0], [9, 0]):
        for kernel in ("cuda.block", "cuda.row"):
            rows = [r for r in compiled if r["cc"] == cc and r["kernel"] == kernel]
            assert rows, f"nothing compiled for {kernel} on sm_{cc[0]}{cc[1]}"
            assert all(r["registers"] > 0 for r in rows)


def spill_bytes(r):
    return r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0)


@pytest.mark.parametrize("kernel", ["cuda.block", "cuda.row"])
def test_default_configs_do_not_spill(report, kernel):
    rows = [r for r in report if r["kernel"] == kernel and "config" in r]
    spills = [r for r in rows if spill_bytes(r) or r.get("stack_bytes", 0)]
    assert rows and not spills, spills
    if kernel == "cuda.row":  # both ways past the registers were compiled: split columns, q shared
        assert any(not r["config"]["HOLDQ"] for r in rows)
        assert any(r["config"]["HOLDQ"] and r["config"]["DV"] < r["d"] for r in rows)


def test_only_sm75_float64_at_d256_is_refused_and_says_why(report):
    refused = [r for r in report if "unsupported" in r]
    assert all(r["cc"] == [7, 5] for r in refused), refused
    assert all("shared memory" in r["unsupported"] for r in refused)


def test_ptx_has_vector_shared_loads_and_no_wraparound():
    out = run_without_simulator("""
        from numflash.cuda import block, launch
        from numflash.cuda.common import forward_signature
        cfg = block.tile_config(64, 64, (64, 64, 8, 4), "float32")
        ptx = launch.compile_ptx(block.make_kernel(**cfg), forward_signature("float32"), (9, 0))
        print(ptx.count("ld.shared.v4.f32"), ptx.count("shr.s64"), ptx.count(".entry"),
              ptx.count("st.shared.v4.f32"))
    """)
    vector_loads, sign_shifts, entries, vector_stores = map(int, out.split()[-4:])
    assert entries == 1
    assert vector_loads >= 6     # Q, K, P and V operands come in 16-byte loads
    assert vector_stores >= 4    # P leaves registers in 16-byte stores (TN keys x TM / 4)
    assert sign_shifts <= 2      # numba's negative-index wraparound is gone from the loops


def test_inspect_cli_check_passes():
    out = run_without_simulator("""
        import sys
        from numflash.inspect import main
        sys.exit(main(["--arch", "90", "--d", "64", "--dtype", "float32", "--kernels",
                       "block,row,mma", "--check"]))
    """)
    assert "cuda.block" in out and "cuda.row" in out
    assert "cuda.mma" in out and "DT=3xtf32" in out  # float32's tensor-core config, no spills


def test_block_configs_for_unequal_head_dims_do_not_spill():
    """The tile class follows the larger of d and dv: dv sizes the output patch in registers."""
    out = run_without_simulator("""
        import json
        from numflash.cuda import block, launch
        from numflash.cuda.common import forward_signature
        from numflash.plan import Device

        class Shape:
            def __init__(self, d, dv, dt):
                self.shape, self.dtype_name = (1, 1, 128, 128, d, dv), dt

        rows = []
        for cc, optin in (((9, 0), 227 * 1024), ((8, 0), 163 * 1024)):
            device = Device(name="sm", cc=cc, smem_per_block_optin=optin)
            for d, dv, dt in ((64, 256, "float32"), (256, 16, "float32"), (64, 256, "float64")):
                cfg = block.config(Shape(d, dv, dt), device)
                res = launch.compile_to_cubin(block.make_kernel(**cfg), forward_signature(dt), cc)[3]
                rows.append([d, dv, dt, res.get("spill_store_bytes", 0), res.get("stack_bytes", 0)])
        print(json.dumps(rows))
    """)
    rows = json.loads(out.splitlines()[-1])
    assert len(rows) == 6 and not [r for r in rows if r[3] or r[4]], rows


def test_faster_numba_analyses_agree_with_numbas_own():
    """launch.compile_ptx swaps two numba-cuda IR analyses for faster equivalents
    (launch.singly_assigned_variables, launch.live_variables). While a real kernel and its
    device functions compile, both must give numba's own results on every call; then a compile
    through the swap itself must call them (where numba-cuda's two functions are the checked
    versions) and leave numba's own in place afterwards."""
    out = run_without_simulator("""
        import contextlib, json
        from numba.cuda import lowering
        from numba.cuda.core import analysis, ir_utils
        from numflash.cuda import launch, mma
        numbas_sav = lowering.Lower._find_singly_assigned_variable
        numbas_live = analysis.compute_live_map
        checked = {"_find_singly_assigned_variable": launch.function_digest(numbas_sav),
                   "compute_live_map": launch.function_digest(numbas_live)
                   } == launch.CHECKED_NUMBA_ANALYSES
        seen = {"singly": [], "live": []}
        def sav_both(self):
            numbas_sav(self)
            seen["singly"].append([len(self._singly_assigned_vars), self._singly_assigned_vars
                                   == launch.singly_assigned_variables(self)])
        def live_both(*args):
            want = numbas_live(*args)
            seen["live"].append([sum(map(len, want.values())),
                                 want == launch.live_variables(*args)])
            return want
        tile = mma.choose_tile(64, 64, "f16", 227 * 1024, 1, (9, 0), False)
        kernel, sig = mma.compiled_kernels(mma.MmaConfig(64, 64, *tile, "f16", 1), "float16")[0]

        lowering.Lower._find_singly_assigned_variable = sav_both
        analysis.compute_live_map = ir_utils.compute_live_map = live_both
        swap = launch._faster_numba_analyses
        launch._faster_numba_analyses = contextlib.nullcontext   # numba's own, checked
        launch.compile_ptx(kernel.pyfunc, sig, (9, 0))

        lowering.Lower._find_singly_assigned_variable = numbas_sav   # now through the swap
        analysis.compute_live_map = ir_utils.compute_live_map = numbas_live
        launch._faster_numba_analyses = swap
        calls = {"singly": 0, "live": 0}
        sav, live = launch.singly_assigned_variables, launch.live_variables
        def counted(name, fn):
            def call(*args):
                calls[name] += 1
                return fn(*args)
            return call
        launch.singly_assigned_variables = counted("singly", sav)
        launch.live_variables = counted("live", live)
        launch.compile_ptx(kernel.pyfunc, sig, (9, 0))
        restored = (lowering.Lower._find_singly_assigned_variable is numbas_sav
                    and analysis.compute_live_map is numbas_live
                    and ir_utils.compute_live_map is numbas_live)
        print(json.dumps({"seen": seen, "checked": checked, "calls": calls,
                          "restored": restored}))
    """)
    got = json.loads(out.splitlines()[-1])
    for name, calls in got["seen"].items():
        assert len(calls) >= 2, (name, calls)              # the kernel and its device functions
        assert max(n for n, _ in calls) > 100, (name, calls)   # real work: many variables
        assert all(same for _, same in calls), (name, calls)
    # the swap runs exactly where numba-cuda's two functions are the checked versions
    assert all((n > 0) == got["checked"] for n in got["calls"].values()), got
    assert got["restored"], got
