"""Every CUDA kernel class on small odd shapes, for compute-sanitizer (issue 22).

    compute-sanitizer --tool memcheck|racecheck|synccheck python bench/sanitize.py

Runs the forward of cuda.block, cuda.row and cuda.mma (float16, bfloat16, float32 3xTF32 and
float64) and cuda.row's backward, causal in both alignments and not, with Nq != Nk, head dims
59/64/111 and GQA, and checks each result against the float64 reference, so that a run is
both a sanitizer run and a correctness run. Prints one line per case.
"""
import sys

import cupy
import numpy as np

import numflash
from numflash import reference

CASES = [  # algorithm, dtype, (B, H, Hk, Nq, Nk, d), causal
    ("block", "float32", (1, 2, 2, 97, 130, 59), "bottom_right"),
    ("block", "float16", (1, 2, 1, 130, 97, 64), True),
    ("block", "float64", (1, 2, 2, 65, 65, 111), False),
    ("row", "float32", (1, 2, 2, 97, 130, 59), True),
    ("mma", "float16", (1, 2, 2, 97, 130, 64), "bottom_right"),
    ("mma", "bfloat16", (1, 2, 1, 130, 97, 128), True),
    ("mma", "float32", (1, 2, 2, 97, 130, 64), False),
    ("mma", "float64", (1, 2, 2, 65, 97, 59), True),
]


def arrays(dtype, shape, seed):
    B, H, Hk, Nq, Nk, d = shape
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s) for s in ((B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, d),
                                              (B, H, Nq, d))]
    if dtype == "bfloat16":
        import torch
        dev = [cupy.from_dlpack(torch.tensor(a, dtype=torch.bfloat16, device="cuda")) for a in host]
        host = [torch.tensor(a, dtype=torch.bfloat16).double().numpy() for a in host]
        return host, dev
    host = [a.astype(dtype) for a in host]
    return host, [cupy.asarray(a) for a in host]


def main():
    bad = 0
    for i, (algorithm, dtype, shape, causal) in enumerate(CASES):
        host, (q, k, v, do) = arrays(dtype, shape, i)
        o, lse = numflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
        ref = reference.attention(*(a.astype(np.float64) for a in host[:3]), causal=causal)
        err = float(np.abs(cupy.asnumpy(o.astype(cupy.float64)) - ref).max())
        tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-10}[dtype]
        line = f"{algorithm:5s} {dtype:8s} {shape} causal={causal}: forward max err {err:.2e}"
        if algorithm == "row" or (algorithm == "mma" and dtype != "float64"):
            dq, dk, dv = numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
            want = reference.attention_backward(*(a.astype(np.float64) for a in
                                                  (host[3], host[0], host[1], host[2])),
                                                causal=causal)
            gerr = max(float(np.abs(cupy.asnumpy(g.astype(cupy.float64)) - w).max())
                       / max(1.0, float(np.abs(w).max())) for g, w in zip((dq, dk, dv), want))
            line += f", backward max rel err {gerr:.2e}"
            err = max(err, gerr)
        ok = np.isfinite(err) and err < tol * 10
        bad += not ok
        print(("ok   " if ok else "BAD  ") + line, flush=True)
    cupy.cuda.Device().synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
