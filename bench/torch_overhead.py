"""Per-call cost of attention on torch CUDA tensors at a size where the host is the bottleneck
(issue "PyTorch, transformers and JAX": B1 H8 N128 d64), numflash.torch against torch's SDPA.

Each method runs `--calls` back-to-back calls on the same inputs, with one synchronize at the
end; wall time / calls is the per-call cost when the GPU keeps up, i.e. host overhead (the kernel
takes a few microseconds at this size). CUDA events around the same loop give the GPU's span per
call. "bare launch" replays numflash's recorded kernel on preallocated outputs: the floor that the
torch layer's own cost sits on. The methods take turns (round robin) for `--repeats` rounds;
medians are shown.

    python bench/torch_overhead.py [--dtype float16] [--calls 2000] [--repeats 7]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import numflash.torch as nt
from numflash.bench.timing import CudaEventTimer, per_call_ms


def loop(timer, fn, calls):
    """(wall us, GPU us) per call over `calls` back-to-back calls."""
    gpu_ms, wall_ms = per_call_ms(timer, fn, calls)
    return wall_ms * 1e3, gpu_ms * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--shape", default="1,8,128,64", help="B,H,N,d")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    B, H, N, d = map(int, a.shape.split(","))
    dtype = getattr(torch, a.dtype)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
    qg = q.clone().requires_grad_()  # the forward of a training step: the graph is recorded

    nt.attention(q, k, v)  # compile + record the launch
    replay = next(r for key, r in nt._replays.items() if key[0] == q.shape and key[6] == dtype)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = (nt.attention(q, k, v).float() - want).abs().max().item()

    methods = {
        "bare launch (numflash kernel, outputs preallocated)": lambda: replay.recipe.launch(stream, ptrs),
        "numflash.torch.attention": lambda: nt.attention(q, k, v),
        "numflash.torch.scaled_dot_product_attention": lambda: nt.scaled_dot_product_attention(q, k, v),
        "numflash.attention (torch tensors in)": lambda: __import__("numflash").attention(q, k, v),
        "torch SDPA (F.scaled_dot_product_attention)": lambda: F.scaled_dot_product_attention(q, k, v),
        "numflash.torch.attention, q requires grad": lambda: nt.attention(qg, k, v),
        "torch SDPA, q requires grad": lambda: F.scaled_dot_product_attention(qg, k, v),
    }
    for fn in methods.values():  # warm-up
        for _ in range(200):
            fn()
    timer = CudaEventTimer("torch")
    samples = {name: [] for name in methods}
    for _ in range(a.repeats):  # round robin, so that drifts of the machine hit every method
        for name, fn in methods.items():
            samples[name].append(loop(timer, fn, a.calls))
    rows = {name: (statistics.median(h for h, _ in s), statistics.median(g for _, g in s))
            for name, s in samples.items()}
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} {a.dtype} B{B} H{H} N{N} "
          f"d{d}; numflash max |err| vs fp32 SDPA {err:.2e}")
    print(f"{'method':55s} {'wall us/call':>13s} {'GPU us/call':>12s}")
    for name, (host, gpu) in rows.items():
        print(f"{name:55s} {host:13.1f} {gpu:12.1f}")
    print(json.dumps({"device": torch.cuda.get_device_name(), "dtype": a.dtype,
                      "shape": [B, H, N, d], "rows": rows, "max_err": err}))


if __name__ == "__main__":
    main()
