"""Every CUDA kernel class on small odd shapes, for compute-sanitizer (issue 22).

    compute-sanitizer --tool memcheck|racecheck|synccheck python bench/sanitize.py [TEXT ...]

(TEXT: run only the later cases whose name holds one of them, e.g. "backward".)

Runs the forward of cuda.block, cuda.row and cuda.mma (float16, bfloat16, float32 3xTF32 and
float64) and cuda.row's backward, causal in both alignments and not, with Nq != Nk, head dims
59/64/111 and GQA; then the paths added since (session 15): split-KV with its merge, the KV
cache contiguous and paged with fuzzed (valid) cache lengths and block tables, varlen with fuzzed
offsets, a block mask and dense mask modifications; and the backward paths since (session 25):
cuda.mma's float64 backward, the backward under a dense mask with softcap, a block mask, a
window, a bias with its gradient, a user score_mod with gradients to its mod_args, dropout, and
varlen. Each result is checked against the float64 reference, so that a run is both a
sanitizer run and a correctness run. Prints one line per case.
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


def _ref(q, k, v, **opts):
    return reference.attention(*(cupy.asnumpy(a.astype(cupy.float64)) for a in (q, k, v)),
                               **opts)


def _err(got, want):
    got = cupy.asnumpy(got.astype(cupy.float64))
    same = np.array_equal(np.isfinite(got), np.isfinite(want))
    ok = np.isfinite(want)
    return float(np.abs(got[ok] - want[ok]).max()) if same else float("nan")


def split_case(rng):
    q = cupy.asarray(rng.standard_normal((2, 4, 3, 64)).astype(np.float16))
    k, v = (cupy.asarray(rng.standard_normal((2, 4, 4099, 64)).astype(np.float16))
            for _ in range(2))
    return _err(numflash.attention(q, k, v, causal=True, num_splits=7),
                _ref(q, k, v, causal=True))


def kvcache_case(rng, paged):
    """Fuzzed cache lengths (and a shuffled block table): one new row appended, then attended."""
    B, H, Hk, d, cap, page = 3, 4, 2, 64, 320, 16
    lens = rng.integers(0, cap - 1, B)
    q = cupy.asarray(rng.standard_normal((B, 1, H, d)).astype(np.float16))
    new_k, new_v = (cupy.asarray(rng.standard_normal((B, 1, Hk, d)).astype(np.float16))
                    for _ in range(2))
    if paged:
        n_pages = B * cap // page
        table = rng.permutation(n_pages).reshape(B, cap // page).astype(np.int32)
        kc, vc = (cupy.asarray(rng.standard_normal((n_pages, page, Hk, d)).astype(np.float16))
                  for _ in range(2))
        rows = lambda c, b: c[cupy.asarray(table[b])].reshape(cap, Hk, d)  # noqa: E731
        extra = {"block_table": cupy.asarray(table)}
    else:
        kc, vc = (cupy.asarray(rng.standard_normal((B, cap, Hk, d)).astype(np.float16))
                  for _ in range(2))
        rows = lambda c, b: c[b]  # noqa: E731
        extra = {}
    out = numflash.attention_with_kvcache(q, kc, vc, new_k, new_v,
                                          cache_seqlens=cupy.asarray(lens.astype(np.int32)),
                                          causal=True, **extra)
    err = 0.0
    for b in range(B):
        n = int(lens[b]) + 1
        kb, vb = (rows(c, b)[:n].transpose(1, 0, 2)[None] for c in (kc, vc))
        if not (cupy.array_equal(kb[0, :, -1], new_k[b, 0]) and
                cupy.array_equal(vb[0, :, -1], new_v[b, 0])):
            return float("nan")   # the append missed its row
        want = _ref(q[b:b + 1].transpose(0, 2, 1, 3), kb, vb, causal="bottom_right")
        err = max(err, _err(out[b:b + 1].transpose(0, 2, 1, 3), want))
    return err


def varlen_case(rng):
    lens_q, lens_k = rng.integers(1, 150, 4), rng.integers(1, 150, 4)
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = cupy.asarray(rng.standard_normal((int(cq[-1]), 4, 64)).astype(np.float16))
    k, v = (cupy.asarray(rng.standard_normal((int(ck[-1]), 2, 64)).astype(np.float16))
            for _ in range(2))
    out = numflash.attention_varlen(q, k, v, cupy.asarray(cq), cupy.asarray(ck), causal=True)
    err = 0.0
    for b in range(4):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        want = _ref(*(a[None].transpose(0, 2, 1, 3) for a in (q[sq], k[sk], v[sk])),
                    causal=True)
        err = max(err, _err(out[sq][None].transpose(0, 2, 1, 3), want))
    return err


def _stripes(b, h, i, j):
    return (i + 2 * j + h) % 5 < 3


def mods_case(rng, block):
    q, k, v = (cupy.asarray(rng.standard_normal((2, 4, 300, 64)).astype(np.float16))
               for _ in range(3))
    if block:
        mask = numflash.create_block_mask(_stripes, None, 4, 300, 300, block_size=64,
                                          device="cuda")
        dense = np.array([[[[_stripes(0, h, i, j) for j in range(300)] for i in range(300)]
                           for h in range(4)]])
        return _err(numflash.attention(q, k, v, block_mask=mask), _ref(q, k, v, attn_mask=dense))
    m = rng.random((2, 1, 300, 300)) > 0.3
    return _err(numflash.attention(q, k, v, attn_mask=cupy.asarray(m), softcap=20.0),
                _ref(q, k, v, attn_mask=m, softcap=20.0))


def _relative(got, want):
    """_err relative to the size of the finite reference values (at least 1)."""
    finite = want[np.isfinite(want)]
    return _err(got, want) / max(1.0, float(np.abs(finite).max(initial=0)))


def backward_case(rng, dtype="float16", shape=(2, 4, 2, 150, 210, 64), return_args=False,
                  **opts):
    """Forward and backward with ``opts`` against the reference's: the largest error relative
    to each output's size (out, dq, dk, dv, and attn_bias's or mod_args' gradients)."""
    B, H, Hk, Nq, Nk, d = shape
    host = [rng.standard_normal(s).astype(dtype) for s in
            ((B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, d), (B, H, Nq, d))]
    q, k, v, do = (cupy.asarray(a) for a in host)
    dev = {n: cupy.asarray(a) if isinstance(a, np.ndarray) else a for n, a in opts.items()}
    if "mod_args" in opts:
        dev["mod_args"] = tuple(cupy.asarray(a) if isinstance(a, np.ndarray) else a
                                for a in opts["mod_args"])
    flags = dict(return_bias_grad="attn_bias" in opts, return_mod_args_grad=return_args)
    o, lse = numflash.attention(q, k, v, return_lse=True, **dev)
    got = numflash.attention_backward(do, q, k, v, o, lse, **dev, **flags)
    h64 = [a.astype(np.float64) for a in host]
    want = reference.attention_backward(h64[3], *h64[:3], **opts, **flags)
    errs = [_relative(o, reference.attention(*h64[:3], **opts))]
    for g, w in zip(got, want):
        if isinstance(g, tuple):   # mod_args' gradients
            errs += [_relative(a, b) for a, b in zip(g, w) if a is not None]
        else:
            errs.append(_relative(g, w))
    return max(errs)


def _bias_table(x, b, h, i, j, table, shift):
    return x + table[h, i - j + shift]


def _bias_table_grad(x, b, h, i, j, table, shift):
    return 1.0


def _table_index(x, b, h, i, j, table, shift):
    return (h, i - j + shift), 1.0


def user_mod_case(rng):
    table = rng.standard_normal((4, 150 + 210))
    return backward_case(rng, "float32", causal="bottom_right", score_mod=_bias_table,
                         score_mod_grad=_bias_table_grad, mod_args=(table, 210),
                         score_mod_args_grad=(_table_index, None), return_args=True)


def varlen_backward_case(rng):
    lens_q, lens_k = rng.integers(1, 150, 4), rng.integers(1, 150, 4)
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    host = [rng.standard_normal((int(c[-1]), h, 64)).astype(np.float16)
            for c, h in ((cq, 4), (ck, 2), (ck, 2), (cq, 4))]
    q, k, v, do = (cupy.asarray(a) for a in host)
    args = (cupy.asarray(cq), cupy.asarray(ck))
    out, lse = numflash.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    grads = numflash.attention_varlen_backward(do, q, k, v, out, lse, *args, causal=True)
    err = 0.0
    for b in range(4):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        seq = [a[s][None].transpose(0, 2, 1, 3).astype(np.float64)
               for a, s in zip(host, (sq, sk, sk, sq))]
        want = reference.attention_backward(seq[3], *seq[:3], causal=True)
        for g, w, s in zip(grads, want, (sq, sk, sk)):
            err = max(err, _relative(g[s][None].transpose(0, 2, 1, 3), w))
    return err


LATER_CASES = [  # name, run(rng) -> max error over finite outputs (NaN: wrong pattern)
    ("float16 split-KV (7 shares) + merge", split_case),
    ("kvcache float16 contiguous, fuzzed lengths", lambda rng: kvcache_case(rng, False)),
    ("kvcache float16 paged 16, fuzzed lengths and table", lambda rng: kvcache_case(rng, True)),
    ("varlen float16, fuzzed offsets", varlen_case),
    ("float16 block mask", lambda rng: mods_case(rng, True)),
    ("float16 attn_mask + softcap", lambda rng: mods_case(rng, False)),
    ("backward float16 attn_mask + softcap, GQA",
     lambda rng: backward_case(rng, attn_mask=rng.random((2, 1, 150, 210)) > 0.3,
                               softcap=20.0)),
    ("backward float16 block mask", lambda rng: backward_case(
        rng, shape=(1, 4, 4, 300, 300, 64), block_mask=numflash.create_block_mask(
            _stripes, None, 4, 300, 300, block_size=128, device="cuda"))),
    ("backward float32 window (37, 5), bottom-right",
     lambda rng: backward_case(rng, "float32", window_size=(37, 5), causal="bottom_right")),
    ("backward float16 attn_bias (1, H, Nq, Nk) + its gradient",
     lambda rng: backward_case(rng, attn_bias=rng.standard_normal((1, 4, 150, 210)))),
    ("backward float32 user score_mod + mod_args gradient", user_mod_case),
    ("backward float16 dropout 0.2, causal", lambda rng: backward_case(
        rng, causal=True, dropout_p=0.2, dropout_seed=12345)),
    ("backward float64 d 59", lambda rng: backward_case(rng, "float64",
                                                        shape=(1, 2, 1, 97, 65, 59))),
    ("varlen backward float16, fuzzed offsets", varlen_backward_case),
]


def main(only=()):
    """Every case; with ``only`` (texts), the later cases whose name holds one of them."""
    bad = 0
    for i, (algorithm, dtype, shape, causal) in enumerate(() if only else CASES):
        host, (q, k, v, do) = arrays(dtype, shape, i)
        o, lse = numflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
        ref = reference.attention(*(a.astype(np.float64) for a in host[:3]), causal=causal)
        err = float(np.abs(cupy.asnumpy(o.astype(cupy.float64)) - ref).max())
        tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-10}[dtype]
        line = f"{algorithm:5s} {dtype:8s} {shape} causal={causal}: forward max err {err:.2e}"
        if algorithm in ("row", "mma"):
            dq, dk, dv = numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
            want = reference.attention_backward(*(a.astype(np.float64) for a in
                                                  (host[3], host[0], host[1], host[2])),
                                                causal=causal)
            gerr = max(_relative(g, w) for g, w in zip((dq, dk, dv), want))
            line += f", backward max rel err {gerr:.2e}"
            err = max(err, gerr)
        ok = np.isfinite(err) and err < tol * 10
        bad += not ok
        print(("ok   " if ok else "BAD  ") + line, flush=True)
    for i, (name, case) in enumerate(LATER_CASES):
        if only and not any(text in name for text in only):
            continue
        err = case(np.random.default_rng(100 + i))
        ok = np.isfinite(err) and err < 2e-2
        bad += not ok
        print(("ok   " if ok else "BAD  ") + f"{name}: max err {err:.2e}", flush=True)
    cupy.cuda.Device().synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
