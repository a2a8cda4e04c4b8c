"""What a score / mask modification costs numflash on the GPU (the planner's kernel, or the
one --algorithm names; the kernel column says which ran), against the same call without it, and
(with --flex) what the same modification costs FlexAttention (torch.compile'd, with its block
mask where the modification is a mask) against its own plain causal call: issue 15's goal is that
a modification costs numflash no more, relative to its own plain kernel, than it costs Flex.
With --cpu, the CPU path (cpu.tiled on NumPy arrays) against PyTorch's CPU SDPA given the
equivalent ``attn_mask`` (boolean for masks, an additive float tensor for ALiBi and biases, built
once outside the timing; SDPA has no softcap, so that row has no peer), in the same process.
SDPA's "causal" row is is_causal=True, its fast path; every masked row is a dense masked call,
so the "causal as a mask" row (both libraries given the causal mask as a boolean attn_mask)
is the base that separates a modification's own cost from the loss of that path.

    python bench/mods_cost.py [--dtype float16] [--d 64] [--N 4096] [--B 4] [--H 16]
                              [--backward] [--flex] [--only softcap,alibi] [--algorithm row]
    python bench/mods_cost.py --cpu [--dtype float32] [--N 2048] [--B 1] [--H 8] [--backward]

Times by CUDA events (numflash.bench.timing.median_ms: warm-up, median of repeats; on the CPU
time.perf_counter), forward, or forward + backward with --backward. Every row is checked against
the float64 reference on sampled rows (forward; SDPA's rows too). A row the forced --algorithm
cannot run (either pass with --backward) prints the planner's refusal instead. Kernels compile
on first use (the first row of each modification; on the CPU in the warm-up, once per process).
"""
import argparse
import sys

import numpy as np


def _doc_mask(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def _rel_bias(score, b, h, i, j, table):
    return score + table[h, i - j + table.shape[1] // 2]


def _unit(score, b, h, i, j, table):
    return 1.0


def _key_padding(b, h, i, j, lengths):
    return j < lengths[b]


#: the sliding-window row's left size
WINDOW = 256


def cases(B, H, N, rng, xp, dtype):
    """name -> numflash options (``xp``: cupy for the GPU, numpy for the CPU path), in the order
    of issue 15's table (the block-mask rows' masks are built once, on the arrays' side, as a
    model would for all its layers)."""
    import numflash
    docs = np.sort(rng.integers(0, 8, (B, N)), axis=1).astype(np.int32)
    lengths = np.array([N - 37 * (b + 1) for b in range(B)])
    dev_docs, dev_lengths = xp.asarray(docs), xp.asarray(lengths)
    tril = np.tril(np.ones((N, N), bool))[None, None]
    return {
        "causal": {},
        "causal as a mask (1, 1, N, N)": dict(attn_mask=xp.asarray(tril)),
        "softcap 30": dict(softcap=30.0),
        f"sliding window ({WINDOW}, 0)": dict(window_size=(WINDOW, 0)),
        "alibi": dict(alibi_slopes=xp.asarray(rng.uniform(0.01, 0.5, H).astype(np.float32))),
        "bias (1, H, N, N)": dict(attn_bias=xp.asarray(
            rng.standard_normal((1, H, N, N)).astype(dtype))),
        "key padding (B, 1, 1, N)": dict(attn_mask=xp.asarray(
            np.arange(N)[None, None, None, :] < lengths[:, None, None, None])),
        "key padding, block mask": dict(block_mask=numflash.create_block_mask(
            _key_padding, B, None, N, N, (dev_lengths,))),
        "document mask (8 docs, mask_mod)": dict(mask_mod=_doc_mask, mod_args=(dev_docs,)),
        "document mask, block mask": dict(block_mask=numflash.create_block_mask(
            _doc_mask, B, None, N, N, (dev_docs,))),
        "relative bias table (score_mod)": dict(
            score_mod=_rel_bias, score_mod_grad=_unit,
            mod_args=(xp.asarray(rng.standard_normal((H, 2 * N + 1)).astype(np.float32)),)),
    }, docs, lengths


def sdpa_masks(table, N, torch, docs, lengths, dtype):
    """The same modifications as PyTorch SDPA ``attn_mask`` tensors on the CPU, causal included
    (SDPA takes is_causal or a mask, not both): name -> mask (None: is_causal=True alone), from
    the very arrays numflash's rows read. SDPA has no softcap: that row is left out."""
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    causal = j <= i
    blocked = torch.zeros(N, N, dtype=dtype).masked_fill(~causal, float("-inf"))
    slopes = torch.as_tensor(table["alibi"]["alibi_slopes"]).to(dtype)
    bias = torch.as_tensor(table["bias (1, H, N, N)"]["attn_bias"]).to(dtype)
    rel = torch.as_tensor(table["relative bias table (score_mod)"]["mod_args"][0]).to(dtype)
    docs_t, lens_t = torch.as_tensor(docs), torch.as_tensor(lengths)
    padding = causal[None, None] & (j[None, None] < lens_t[:, None, None, None])
    documents = causal[None, None] & (docs_t[:, None, :, None] == docs_t[:, None, None, :])
    masks = {
        "causal": None,
        "causal as a mask (1, 1, N, N)": causal[None, None],
        f"sliding window ({WINDOW}, 0)": (causal & (i - j <= WINDOW))[None, None],
        "alibi": (blocked - slopes[:, None, None] * (i - j).abs().to(dtype))[None],
        "bias (1, H, N, N)": bias + blocked,
        "key padding (B, 1, 1, N)": padding,
        "key padding, block mask": padding,
        "document mask (8 docs, mask_mod)": documents,
        "document mask, block mask": documents,
        "relative bias table (score_mod)": (rel[:, i - j + rel.shape[1] // 2] + blocked)[None],
    }
    return masks


def flex_cases(B, H, N, torch, docs, lengths):
    """The same modifications for FlexAttention: name -> (score_mod, mask_mod or None)."""
    dev = "cuda"
    slopes = torch.rand(H, device=dev) * 0.49 + 0.01
    bias = torch.randn(1, H, N, N, device=dev, dtype=torch.float16)
    docs_t = torch.as_tensor(docs, device=dev)
    lens_t = torch.as_tensor(lengths, device=dev)
    table = torch.randn(H, 2 * N + 1, device=dev)

    def causal(b, h, q, kv):
        return q >= kv
    rows = {
        "causal": (None, causal),
        "softcap 30": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), causal),
        f"sliding window ({WINDOW}, 0)": (None, lambda b, h, q, kv: (q >= kv) &
                                          (q - kv <= WINDOW)),
        "alibi": (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), causal),
        "bias (1, H, N, N)": (lambda s, b, h, q, kv: s + bias[0, h, q, kv], causal),
        "key padding (B, 1, 1, N)": (None, lambda b, h, q, kv: (q >= kv) & (kv < lens_t[b])),
        "document mask (8 docs, mask_mod)": (
            None, lambda b, h, q, kv: (q >= kv) & (docs_t[b, q] == docs_t[b, kv])),
        "relative bias table (score_mod)": (lambda s, b, h, q, kv: s + table[h, q - kv + N],
                                            causal),
    }
    rows["causal as a mask (1, 1, N, N)"] = rows["causal"]
    rows["key padding, block mask"] = rows["key padding (B, 1, 1, N)"]
    rows["document mask, block mask"] = rows["document mask (8 docs, mask_mod)"]
    return rows


def _host_options(opts):
    """A row's options for the float64 reference on the host (a block mask as its mask_mod)."""
    host = dict(opts)
    if "block_mask" in host:
        bm = host.pop("block_mask")
        host.update(mask_mod=bm.mask_mod, mod_args=bm.mod_args)
    get = (lambda x: x.get() if hasattr(x, "get") else x)
    return {n: (tuple(get(x) for x in o) if n == "mod_args" else get(o)) for n, o in host.items()}


def _sdpa_call(torch, tensors, mask, backward):
    """PyTorch's CPU SDPA with the row's mask (is_causal alone where it has none)."""
    import torch.nn.functional as F
    fq, fk, fv, fdo = tensors

    def call():
        with torch.set_grad_enabled(backward):
            out = F.scaled_dot_product_attention(fq, fk, fv, attn_mask=mask,
                                                 is_causal=mask is None)
            if backward:
                torch.autograd.grad(out, (fq, fk, fv), fdo)
        return out
    return call


def main():
    import numflash
    from numflash.bench.timing import HostTimer, median_ms
    from numflash.testing import check
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU path against torch's CPU SDPA")
    ap.add_argument("--dtype", default=None, help="default float16 (GPU), float32 (--cpu)")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--N", type=int, default=None, help="default 4096 (GPU), 2048 (--cpu)")
    ap.add_argument("--B", type=int, default=None, help="default 4 (GPU), 1 (--cpu)")
    ap.add_argument("--H", type=int, default=None, help="default 16 (GPU), 8 (--cpu)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--algorithm", default="auto",
                    help="numflash's algorithm on the GPU (auto, mma, row, ...): the kernel column "
                         "says which ran")
    a = ap.parse_args()
    dtype = a.dtype or ("float32" if a.cpu else "float16")
    B, H, N, d = (a.B or (1 if a.cpu else 4), a.H or (8 if a.cpu else 16),
                  a.N or (2048 if a.cpu else 4096), a.d)
    if a.cpu:
        xp, timer, algo = np, HostTimer(), {}
    else:
        import cupy as xp
        timer, algo = None, dict(algorithm=a.algorithm)
    rng = np.random.default_rng(0)
    q, k, v, do = (xp.asarray(rng.standard_normal((B, H, N, d)).astype(np.float32))
                   .astype(dtype) for _ in range(4))
    table, docs, lengths = cases(B, H, N, rng, xp, np.float32 if dtype == "float32" else dtype)
    only = [s for s in a.only.split(",") if s]
    peer = None   # name -> the peer's call for that row
    if a.cpu:
        import torch
        tensors = [torch.from_numpy(np.array(x)).requires_grad_(a.backward and i < 3)
                   for i, x in enumerate((q, k, v, do))]
        masks = sdpa_masks(table, N, torch, docs, lengths, tensors[0].dtype)
        peer = {n: _sdpa_call(torch, tensors, m, a.backward) for n, m in masks.items()}
        peer_name = f"torch {torch.__version__} CPU SDPA"
    elif a.flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention)
        fq, fk, fv, fdo = (torch.as_tensor(x, device="cuda") for x in (q, k, v, do))
        fq, fk, fv = (x.detach().requires_grad_(a.backward) for x in (fq, fk, fv))
        peer = {}
        for name, (score_mod, mask_mod) in flex_cases(B, H, N, torch, docs, lengths).items():
            def fcall(score_mod=score_mod, block=create_block_mask(mask_mod, B, H, N, N,
                                                                   device="cuda")):
                out = compiled(fq, fk, fv, score_mod=score_mod, block_mask=block)
                if a.backward:
                    torch.autograd.grad(out, (fq, fk, fv), fdo)
                return out
            peer[name] = fcall
        peer_name = "Flex"
    what = "forward + backward" if a.backward else "forward"
    clock = "time.perf_counter" if a.cpu else "CUDA events"
    print(f"numflash {what}, {dtype} B{B} H{H} N{N} d{d}, causal; {clock}, median of {a.reps}")
    short = "SDPA" if a.cpu else "Flex"
    print("| modification | kernel | numflash ms | / its causal | checked |" +
          (f" {short} ms | {short} / its causal | numflash / {short} |" +
           (" SDPA checked |" if a.cpu else "") if peer else ""))
    print("|---|---|---|---|---|" + ("---|---|---|" + ("---|" if a.cpu else "") if peer else ""))
    if peer:
        print(f"  (peer: {peer_name})", file=sys.stderr)
    base = pbase = None
    no_peer = " - | - | - |" + (" - |" if a.cpu else "")   # a row's peer cells, left empty
    host_q, host_k, host_v = (x.get() if hasattr(x, "get") else x for x in (q, k, v))
    for name, opts in table.items():
        if only and name != "causal" and not any(o in name for o in only):
            continue
        print(f"  timing {name} ...", file=sys.stderr, flush=True)

        def call():
            if not a.backward:
                return numflash.attention(q, k, v, causal=True, **algo, **opts)
            o, lse = numflash.attention(q, k, v, causal=True, return_lse=True, **algo, **opts)
            return numflash.attention_backward(do, q, k, v, o, lse, causal=True, **algo, **opts)
        try:
            # both passes with --backward: a forced algorithm must run each
            plan = [numflash.explain(q, k, v, causal=True, backward=b, **algo, **opts)
                    for b in sorted({False, a.backward})][-1]
        except ValueError as refusal:   # the planner's refusal: a forced --algorithm can't run it
            print(f"| {name} | refused: {refusal} | - | - | - |" + (no_peer if peer else ""),
                  flush=True)
            continue
        ms = median_ms(call, reps=a.reps, timer=timer)
        base = base or ms
        rows = np.sort(rng.choice(N, 64, replace=False))
        host = _host_options(opts)

        def checked(out):
            if a.backward:
                return "-"
            out = out.get() if hasattr(out, "get") else np.asarray(out)
            rep = check(out, host_q, host_k, host_v, causal=True, rows=rows, **host)
            return "ok" if rep.ok else f"FAIL {rep}"
        line = f"| {name} | {plan.kernel} | {ms:.3f} | {ms / base:.2f} | {checked(call())} |"
        if peer is not None and name in peer:
            pms = median_ms(peer[name], reps=a.reps, timer=timer)
            pbase = pbase or pms
            line += f" {pms:.3f} | {pms / pbase:.2f} | {ms / pms:.2f} |"
            if a.cpu:
                line += f" {checked(peer[name]().detach().numpy())} |"
        elif peer is not None:
            line += no_peer
        print(line, flush=True)


if __name__ == "__main__":
    main()
