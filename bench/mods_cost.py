"""What a score / mask modification costs on cuda.mma, against the same call without it, and
(with --flex) what the same modification costs FlexAttention (torch.compile'd, with its block
mask where the modification is a mask) against its own plain causal call: issue 15's goal is that
a modification costs numflash no more, relative to its own plain kernel, than it costs Flex.

    python bench/mods_cost.py [--dtype float16] [--d 64] [--N 4096] [--B 4] [--H 16]
                              [--backward] [--flex] [--only softcap,alibi]

Times by CUDA events (numflash.bench.timing.median_ms: warm-up, median of repeats), forward, or
forward + backward with --backward. Every numflash row is checked against the float64 reference
on sampled rows (forward). Kernels compile on first use (the first row of each modification).
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


def cases(B, H, N, rng, cupy, dtype):
    """name -> numflash options (on the GPU), in the order of issue 15's table (the block-mask
    rows' masks are built on the GPU here, once, as a model would for all its layers)."""
    import numflash
    docs = np.sort(rng.integers(0, 8, (B, N)), axis=1).astype(np.int32)
    lengths = np.array([N - 37 * (b + 1) for b in range(B)])
    dev_docs, dev_lengths = cupy.asarray(docs), cupy.asarray(lengths)
    return {
        "causal": {},
        "softcap 30": dict(softcap=30.0),
        "alibi": dict(alibi_slopes=cupy.asarray(rng.uniform(0.01, 0.5, H).astype(np.float32))),
        "bias (1, H, N, N)": dict(attn_bias=cupy.asarray(
            rng.standard_normal((1, H, N, N)).astype(dtype))),
        "key padding (B, 1, 1, N)": dict(attn_mask=cupy.asarray(
            np.arange(N)[None, None, None, :] < lengths[:, None, None, None])),
        "key padding, block mask": dict(block_mask=numflash.create_block_mask(
            _key_padding, B, None, N, N, (dev_lengths,))),
        "document mask (8 docs, mask_mod)": dict(mask_mod=_doc_mask, mod_args=(dev_docs,)),
        "document mask, block mask": dict(block_mask=numflash.create_block_mask(
            _doc_mask, B, None, N, N, (dev_docs,))),
        "relative bias table (score_mod)": dict(
            score_mod=_rel_bias, score_mod_grad=_unit,
            mod_args=(cupy.asarray(rng.standard_normal((H, 2 * N + 1)).astype(np.float32)),)),
    }, docs, lengths


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
        "alibi": (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), causal),
        "bias (1, H, N, N)": (lambda s, b, h, q, kv: s + bias[0, h, q, kv], causal),
        "key padding (B, 1, 1, N)": (None, lambda b, h, q, kv: (q >= kv) & (kv < lens_t[b])),
        "document mask (8 docs, mask_mod)": (
            None, lambda b, h, q, kv: (q >= kv) & (docs_t[b, q] == docs_t[b, kv])),
        "relative bias table (score_mod)": (lambda s, b, h, q, kv: s + table[h, q - kv + N],
                                            causal),
    }
    rows["key padding, block mask"] = rows["key padding (B, 1, 1, N)"]
    rows["document mask, block mask"] = rows["document mask (8 docs, mask_mod)"]
    return rows


def main():
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    from numflash.testing import check
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    B, H, N, d = a.B, a.H, a.N, a.d
    q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(np.float32))
                   .astype(a.dtype) for _ in range(4))
    table, docs, lengths = cases(B, H, N, rng, cupy, np.float32 if a.dtype == "float32"
                                 else a.dtype)
    only = [s for s in a.only.split(",") if s]
    flex = None
    if a.flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention)
        fq, fk, fv, fdo = (torch.as_tensor(x, device="cuda") for x in (q, k, v, do))
        fq, fk, fv = (x.detach().requires_grad_(a.backward) for x in (fq, fk, fv))
        flex = flex_cases(B, H, N, torch, docs, lengths)
    what = "forward + backward" if a.backward else "forward"
    print(f"cuda.mma {what}, {a.dtype} B{B} H{H} N{N} d{d}, causal; CUDA events, median")
    print("| modification | numflash ms | / its causal | checked |" +
          (" Flex ms | Flex / its causal | numflash / Flex |" if flex else ""))
    print("|---|---|---|---|" + ("---|---|---|" if flex else ""))
    base = fbase = None
    for name, opts in table.items():
        if only and name != "causal" and not any(o in name for o in only):
            continue
        print(f"  timing {name} ...", file=sys.stderr, flush=True)

        def call():
            if not a.backward:
                return numflash.attention(q, k, v, causal=True, **opts)
            o, lse = numflash.attention(q, k, v, causal=True, return_lse=True, **opts)
            return numflash.attention_backward(do, q, k, v, o, lse, causal=True, **opts)
        plan = numflash.explain(q, k, v, causal=True, backward=a.backward, **opts)
        assert plan.kernel == "cuda.mma", str(plan)
        ms = median_ms(call)
        base = base or ms
        checked = "-"
        if not a.backward:
            rows = np.sort(rng.choice(N, 64, replace=False))
            host = dict(opts)
            if "block_mask" in host:   # the reference takes the block mask's mask_mod
                bm = host.pop("block_mask")
                host.update(mask_mod=bm.mask_mod, mod_args=bm.mod_args)
            host = {n: (tuple(x.get() if hasattr(x, "get") else x for x in o) if n == "mod_args"
                        else (o.get() if hasattr(o, "get") else o)) for n, o in host.items()}
            rep = check(call().get(), q.get(), k.get(), v.get(), causal=True, rows=rows, **host)
            checked = "ok" if rep.ok else f"FAIL {rep}"
        line = f"| {name} | {ms:.3f} | {ms / base:.2f} | {checked} |"
        if flex:
            score_mod, mask_mod = flex[name]
            block = create_block_mask(mask_mod, B, H, N, N, device="cuda")

            def fcall():
                out = compiled(fq, fk, fv, score_mod=score_mod, block_mask=block)
                if a.backward:
                    torch.autograd.grad(out, (fq, fk, fv), fdo)
                return out
            fms = median_ms(fcall)
            fbase = fbase or fms
            line += f" {fms:.3f} | {fms / fbase:.2f} | {ms / fms:.2f} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
