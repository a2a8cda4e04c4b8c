"""Compile one cuda.mma kernel variant to a cubin for one architecture, with no GPU: in a
subprocess, since conftest turns numba's simulator on in the test process. Returns ptxas's
resources and how often each given string occurs in the PTX."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the element type the kernel reads q, k, v, out as (16-bit kernels take the bits)
ELEMENT = {"f16": "uint16", "bf16": "uint16", "tf32": "float32", "3xtf32": "float32",
           "f64": "float64"}

_SCRIPT = textwrap.dedent("""
    import json, sys
    from numba import types
    from numflash.cuda import launch, mma
    cfg, cc, ops, elem = (json.loads(a) for a in sys.argv[1:5])
    A = types.Array(getattr(types, elem), 4, "A")
    lse = types.Array(types.float64 if elem == "float64" else types.float32, 3, "A")
    args = (A, A, A, A, lse, types.Array(types.float32, 4, "A"),
            types.float64, types.float64, types.int64, types.int64)
    cubin, entry, ptx, res = launch.compile_to_cubin(mma.make_kernel(**cfg), args, tuple(cc))
    print(json.dumps({"resources": res, "ops": {op: ptx.count(op) for op in ops},
                      "cubin_bytes": len(cubin)}))
""")


def compile_variant(cfg, cc, ops=()):
    ops = list(ops) + ["ld.local", "st.local"]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [json.dumps(x) for x in (cfg, list(cc), ops, ELEMENT[cfg["DT"]])]
    run = subprocess.run([sys.executable, "-c", _SCRIPT, *argv], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_register_resident(got):
    """Fragments stayed in registers: no local memory in the PTX, no spills or stack in ptxas."""
    ops, res = got["ops"], got["resources"]
    assert ops["ld.local"] == 0 and ops["st.local"] == 0, "fragments fell into local memory"
    assert res.get("spill_store_bytes", 0) == 0 and res.get("spill_load_bytes", 0) == 0, res
    assert res.get("stack_bytes", 0) == 0, res
    assert got["cubin_bytes"] > 0
