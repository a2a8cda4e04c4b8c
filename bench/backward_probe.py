"""Time numflash's backward against PyTorch SDPA's backward on the GPU, same inputs, same run.

CUDA events, warm-up, median of repeats, fresh inputs per row; every numflash gradient is checked
against the float64 reference (on a slice of heads) first. Backward alone = (fwd + bwd) - fwd for
the peers (autograd), and attention_backward alone for numflash. TFLOP/s counts 2.5x the
forward's 4 B H Nq Nk d FLOPs (halved when causal), as the issue's table does.

    python bench/backward_probe.py            (prints a markdown table)
"""
import statistics
import sys

import cupy
import numpy as np

import numflash
from numflash import testing

CASES = [  # B, H, N, d, dtype, causal
    (4, 16, 4096, 64, "float32", False),
    (4, 16, 4096, 128, "float32", False),
    (4, 16, 4096, 64, "float32", True),
    (4, 16, 4096, 64, "float64", False),
    (4, 16, 4096, 64, "float16", False),
]


def events_ms(fn, repeats=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def torch_backward_ms(q, k, v, do, causal, backend):
    import torch
    from torch.nn.attention import sdpa_kernel
    t = [torch.from_dlpack(a).requires_grad_(i < 3) for i, a in enumerate((q, k, v, do))]
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel([backend]):
            fwd = events_ms(lambda: f(*t[:3], is_causal=causal))

            def both():
                out = f(*t[:3], is_causal=causal)
                out.backward(t[3])
            both_ms = events_ms(both)
    except RuntimeError as e:
        return None, str(e).splitlines()[0][:60]
    return both_ms - fwd, None


def main():
    from torch.nn.attention import SDPBackend
    rows = ["| case | numflash bwd ms | TFLOP/s | SDPA math | SDPA mem-eff | SDPA flash | check |",
            "|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for B, H, N, d, dtype, causal in CASES:
        q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(dtype))
                       for _ in range(4))
        o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
        rep = testing.check_backward([g[:, :1] for g in grads], do[:, :1], q[:, :1], k[:, :1],
                                     v[:, :1], causal=causal)
        ms = events_ms(lambda: numflash.attention_backward(do, q, k, v, o, lse, causal=causal))
        flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
        peers = []
        for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
            t, why = torch_backward_ms(q, k, v, do, causal, backend)
            peers.append(f"{t:.2f} ({t / ms:.2f}x)" if t else "n/a")
        rows.append(f"| B{B} H{H} N{N} d{d} {dtype}{' causal' if causal else ''} | {ms:.2f} | "
                    f"{flops / ms / 1e9:.1f} | " + " | ".join(peers) + f" | {'ok' if rep.ok else rep} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
