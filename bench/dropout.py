"""What attention dropout costs: numflash (cuda.mma's DROP variants) against itself without
dropout and against torch's SDPA flash kernel with and without dropout, in the same run.

    python bench/dropout.py [--quick]      (a CUDA GPU and torch)

float16 / bfloat16, B2 H16 N4096 (N2048 with --quick), d 64 and 128, causal and not. Forward:
numflash.torch.attention vs F.scaled_dot_product_attention under the flash backend; training
step: forward + backward through autograd for both (fresh dO). CUDA events on torch's stream, one
warm-up call each, then the median of 10 calls taken in alternating order. numflash gets a fixed
seed (the call draws none); SDPA draws its Philox state per call, as it does in training.
A second table times numflash alone on CuPy arrays (numflash.attention, attention_backward),
the kernels without the torch layer's host work: the cost of the dropout in the kernels."""
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import numflash.torch as nt
from numflash.bench.timing import CudaEventTimer, median_ms


def main(quick=False):
    print(torch.cuda.get_device_name(0), flush=True)
    timer = CudaEventTimer("torch")
    B, H, N = 2, 16, 2048 if quick else 4096
    print("| dtype | d | causal | numflash fwd p=0 / p=0.1 (ms) | SDPA flash fwd p=0 / p=0.1 |"
          " numflash fwd+bwd p=0 / p=0.1 | SDPA flash fwd+bwd p=0 / p=0.1 |"
          " SDPA time / numflash time at p=0.1 (fwd, fwd+bwd; > 1: numflash faster) |")
    print("|---|---|---|---|---|---|---|---|")
    for dt in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(d)
                q, k, v, do = (torch.randn(B, H, N, d, generator=g, device="cuda").to(dt)
                               for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_(True)

                def ours(p):
                    return nt.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=5)

                def sdpa(p):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, dropout_p=p,
                                                              is_causal=causal)

                def forward(fn, p):
                    def call():
                        with torch.no_grad():
                            return fn(p)
                    return call

                def step(fn, p):
                    return lambda: torch.autograd.grad(fn(p), (q, k, v), do)
                calls = {(name, kind, p): make(fn, p) for name, fn in (("ours", ours),
                                                                       ("sdpa", sdpa))
                         for kind, make in (("fwd", forward), ("step", step))
                         for p in (0.0, 0.1)}
                times = {key: [] for key in calls}
                for key, call in calls.items():
                    call()   # warm-up: compiles, memory pools
                for rep in range(10):
                    order = list(calls.items())
                    for key, call in (order if rep % 2 == 0 else order[::-1]):
                        times[key].append(timer(call)[1])
                ms = {key: statistics.median(t) for key, t in times.items()}

                def pair(name, kind):
                    return f"{ms[(name, kind, 0.0)]:.3f} / {ms[(name, kind, 0.1)]:.3f}"
                print(f"| {str(dt)[6:]} | {d} | {causal} | {pair('ours', 'fwd')} | "
                      f"{pair('sdpa', 'fwd')} | {pair('ours', 'step')} | {pair('sdpa', 'step')} "
                      f"| {ms[('sdpa', 'fwd', 0.1)] / ms[('ours', 'fwd', 0.1)]:.2f}x, "
                      f"{ms[('sdpa', 'step', 0.1)] / ms[('ours', 'step', 0.1)]:.2f}x |",
                      flush=True)


def kernels(quick=False):
    import cupy
    import ml_dtypes
    import numpy as np
    import numflash
    timer = CudaEventTimer("cupy")
    B, H, N = 2, 16, 2048 if quick else 4096
    print("\n| dtype | d | causal | forward p=0 / p=0.1 (ms) | ratio | backward p=0 / p=0.1 |"
          " ratio |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for d in (64, 128):
            for causal in (True, False):
                q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(dt))
                               for _ in range(4))
                ms = {}
                for p in (0.0, 0.1):
                    opts = dict(causal=causal, dropout_p=p, dropout_seed=5)
                    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
                    calls = {"fwd": lambda: numflash.attention(q, k, v, **opts),
                             "bwd": lambda: numflash.attention_backward(do, q, k, v, o, lse,
                                                                        **opts)}
                    for kind, call in calls.items():
                        ms[kind, p] = median_ms(call, reps=10, warmup=1, timer=timer)
                print(f"| {dt.name} | {d} | {causal} | {ms['fwd', 0.0]:.3f} / "
                      f"{ms['fwd', 0.1]:.3f} | {ms['fwd', 0.1] / ms['fwd', 0.0]:.2f} | "
                      f"{ms['bwd', 0.0]:.3f} / {ms['bwd', 0.1]:.3f} | "
                      f"{ms['bwd', 0.1] / ms['bwd', 0.0]:.2f} |", flush=True)


if __name__ == "__main__":
    kernels(quick="--quick" in sys.argv)
    if "--kernels" not in sys.argv:
        main(quick="--quick" in sys.argv)
