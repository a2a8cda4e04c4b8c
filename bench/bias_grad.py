"""What attn_bias's gradient costs: numflash's backward with an attn_bias, without and with
``return_bias_grad`` (cuda.mma's DBIAS key pass), and a training step with a trainable float
mask through numflash.torch's SDPA against torch's own SDPA (which runs such a mask on its
memory-efficient kernel), in the same run.

    python bench/bias_grad.py [--d 64] [--quick] [--kernels] [--padding-only]
                                            (a CUDA GPU; torch for the second table)

float16, B2 H16 N4096 (N2048 with --quick). Bias shapes: (B, H, N, N) (one add an element,
float32), (1, H, N, N) (shared by the batch: relative-position biases) and (B, 1, 1, N) (a key
padding bias: H x N adds an element), the last two summed in float64 by atomic adds. CUDA
events, one warm-up call each, then the median of 10 calls (numflash.bench.timing)."""
import statistics
import sys

import numpy as np

from numflash.bench.timing import CudaEventTimer, median_ms


def kernels(d, quick=False, padding_only=False):
    import cupy
    import numflash
    timer = CudaEventTimer("cupy")
    B, H, N = 2, 16, 2048 if quick else 4096
    print("\n| bias shape | d | causal | backward without / with the bias gradient (ms) | "
          "ratio |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(np.float16))
                   for _ in range(4))
    for shape in ((B, H, N, N), (1, H, N, N), (B, 1, 1, N))[2 if padding_only else 0:]:
        bias = cupy.asarray(rng.standard_normal(shape).astype(np.float32))
        for causal in (False, True):
            opts = dict(causal=causal, attn_bias=bias)
            o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
            ms = {}
            for want in (False, True):
                def call():
                    return numflash.attention_backward(do, q, k, v, o, lse,
                                                       return_bias_grad=want, **opts)
                ms[want] = median_ms(call, reps=10, warmup=1, timer=timer)  # warm-up: compiles
            print(f"| {shape} | {d} | {causal} | {ms[False]:.3f} / {ms[True]:.3f} | "
                  f"{ms[True] / ms[False]:.2f} |", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


def training_step(d, quick=False):
    import torch
    import torch.nn.functional as F
    import numflash.torch as nt
    print(torch.cuda.get_device_name(0), flush=True)
    timer = CudaEventTimer("torch")
    B, H, N = 2, 16, 2048 if quick else 4096
    print("\n| mask shape | d | numflash fwd+bwd (ms) | SDPA fwd+bwd (ms) | SDPA / numflash |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = (torch.randn(B, H, N, d, generator=g, device="cuda").half()
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    for shape in ((1, H, N, N), (B, 1, 1, N)):
        mask = torch.randn(*shape, generator=g, device="cuda").half().requires_grad_(True)
        calls = {name: (lambda fn=fn: torch.autograd.grad(fn(q, k, v, attn_mask=mask),
                                                          (q, k, v, mask), do))
                 for name, fn in (("ours", nt.scaled_dot_product_attention),
                                  ("sdpa", F.scaled_dot_product_attention))}
        times = {name: [] for name in calls}
        for call in calls.values():
            call()   # warm-up
        for rep in range(10):
            order = list(calls.items())
            for name, call in (order if rep % 2 == 0 else order[::-1]):
                times[name].append(timer(call)[1])
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {tuple(shape)} | {d} | {ms['ours']:.3f} | {ms['sdpa']:.3f} | "
              f"{ms['sdpa'] / ms['ours']:.2f}x |", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    d = int(args[args.index("--d") + 1]) if "--d" in args else 64
    kernels(d, quick="--quick" in args, padding_only="--padding-only" in args)
    if "--kernels" not in args:
        training_step(d, quick="--quick" in args)
