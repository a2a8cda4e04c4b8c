"""What grad_dtype=float32 costs: the 16-bit backward storing its float32 accumulators (cuda.mma's
GRAD32) against the plain one rounding them to 16 bits, B1 H32 N16384 causal, d 64 and 128.

    python bench/grad_dtype.py        (a CUDA GPU and torch)

Same inputs for both; CUDA events on torch's stream, one warm-up call each, median of 10 calls
each in alternating order; torch tensors through numflash.attention_backward."""
import statistics, torch, numflash
from numflash.bench.timing import CudaEventTimer
print(torch.cuda.get_device_name(0), flush=True)
timer = CudaEventTimer("torch")
for dt in (torch.float16, torch.bfloat16):
    for d in (64, 128):
        B, H, N = 1, 32, 16384
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v, do = (torch.randn(B, H, N, d, generator=g, device="cuda").to(dt) for _ in range(4))
        o, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
        res = {None: [], torch.float32: []}
        for gd in res:
            numflash.attention_backward(do, q, k, v, o, lse, causal=True, grad_dtype=gd)
        for rep in range(10):
            for gd in ((None, torch.float32) if rep % 2 == 0 else (torch.float32, None)):
                _, ms, _ = timer(lambda: numflash.attention_backward(
                    do, q, k, v, o, lse, causal=True, grad_dtype=gd))
                res[gd].append(ms)
        a, b = statistics.median(res[None]), statistics.median(res[torch.float32])
        print(f"{dt} d{d} B{B} H{H} N{N} causal: plain {a:.3f} ms, grad_dtype float32 {b:.3f} ms,"
              f" ratio {b / a:.3f}", flush=True)
