"""One-shot GPU check of the tensor-core kernel (numflash.cuda.mma): run from the repo root as

    python3 bench/mma_probe.py            # everything (< 3 minutes on an H100)
    python3 bench/mma_probe.py units s    # only some sections (names below)

Sections, each case isolated (an exception prints a compact traceback and the run goes on):
  units  every inline-PTX intrinsic of numflash/cuda/ptx.py alone against numpy
  s      the S = Q K^T stage alone: the kernel built with DBG=1 writes tile 0's masked raw scores
  cases  the whole kernel against numflash.testing.check (float16), both staging paths
  bf16   bfloat16 through the kernel (bits built in numpy; also the public API if this CuPy can
         hold bfloat16 arrays)
  time   B=4, H=16, N=4096, d=64/128, causal or not: mma vs CuPy naive fp16 vs torch SDPA flash
  tf32   precision="tf32" (float32 on m16n8k8 tf32 mma): cvt.rna.tf32 and mma_tf32 alone, the
         kernel against the float64 reference (rel err < 5e-3, lse within 1e-2), and a timing
         line vs the exact fp32 cuda.block at B=4 H=16 N=4096 d=64
  f64    float64 on float64 tensor cores: both mma_f64 forms alone, the kernel against the
         reference (the tests' accuracy rule), tile variants timed vs CuPy naive float64 and
         cuda.block at B=4 H=16 N=4096 d=64/128
"""
import dataclasses
import math
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T0 = time.time()
RESULTS = {"PASS": 0, "FAIL": 0}


def short_tb(e):
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f"{os.path.basename(f.filename)}:{f.lineno}" for f in tb[-4:]]
    msg = str(e).strip().splitlines()
    msg = " | ".join(msg[:3] + (["..."] if len(msg) > 6 else []) + msg[-3:] if len(msg) > 6
                     else msg)
    return f"{type(e).__name__}: {msg[:600]}  @ {' <- '.join(reversed(frames))}"


def case(name, fn):
    t = time.time()
    try:
        ok, detail = fn()
    except CompiledOnly as e:
        ok, detail = True, str(e)
    except Exception as e:  # noqa: BLE001 - report and go on
        ok, detail = False, short_tb(e)
    RESULTS["PASS" if ok else "FAIL"] += 1
    print(f"{'PASS' if ok else 'FAIL'} {name:58s} {detail}  ({time.time() - t:.1f}s)", flush=True)
    return ok


# ----------------------------------------------------------------------------- bf16 helpers

def bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- units

COMPILE_ONLY = os.environ.get("MMA_PROBE_COMPILE_ONLY") == "1"  # offline check: compile, no launch


class CompiledOnly(Exception):
    pass


def launch_(kern, grid, block, *args, cc=(8, 0)):
    """kern[grid, block](*args), or (MMA_PROBE_COMPILE_ONLY=1, no GPU) compile it for cc."""
    if COMPILE_ONLY:
        from numba import typeof
        from numflash.cuda import launch
        ptx = launch.compile_ptx(kern.py_func, [typeof(a) for a in args], cc)
        raise CompiledOnly(f"compiled only ({len(ptx)} chars of PTX)")
    kern[grid, block](*args)

def units():
    from numba import cuda, uint32
    from numflash.cuda import ptx

    rng = np.random.default_rng(0)

    def frag_a(A, lane):
        g, t = lane >> 2, lane & 3
        return [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]

    def pack_rows(M, coords, bits):
        return [int(bits[r, c]) | (int(bits[r, c + 1]) << 16) for r, c in coords]

    def mma_check(kind):
        A = rng.standard_normal((16, 16)).astype(np.float32)
        Bm = rng.standard_normal((16, 8)).astype(np.float32)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        if kind == "f16":
            Ab, Bb = A.astype(np.float16).view(np.uint16), Bm.astype(np.float16).view(np.uint16)
            Av, Bv = A.astype(np.float16).astype(np.float64), Bm.astype(np.float16).astype(np.float64)
            fn = ptx.mma_f16
        else:
            Ab, Bb = bf16_bits(A), bf16_bits(Bm)
            Av, Bv = bf16_value(Ab).astype(np.float64), bf16_value(Bb).astype(np.float64)
            fn = ptx.mma_bf16
        af = np.zeros((32, 4), np.uint32)
        bf = np.zeros((32, 2), np.uint32)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            af[lane] = pack_rows(Ab, frag_a(Ab, lane), Ab)
            BT = Bb.T  # B[k, n] -> BT[n, k]: b0 = B[2t:2t+2, g]
            bf[lane] = [int(BT[g, 2 * t]) | (int(BT[g, 2 * t + 1]) << 16),
                        int(BT[g, 2 * t + 8]) | (int(BT[g, 2 * t + 9]) << 16)]
        D = run_mma_fragments(fn, af, bf, c_fragments(C))
        ref = Av @ Bv + C
        err = float(np.abs(D - ref).max())
        return err < 1e-3, f"max abs err {err:.2e}"

    case("ptx.mma_f16 (m16n8k16, C added)", lambda: mma_check("f16"))
    case("ptx.mma_bf16", lambda: mma_check("bf16"))

    def pack_check(kind):
        x = np.concatenate([rng.standard_normal(1000) * 10, [0.0, -0.0, 65504.0, 1e-8, 3.3e38,
                                                              -np.inf]]).astype(np.float32)
        if len(x) % 2:
            x = x[:-1]
        fn = ptx.pack_f16x2 if kind == "f16" else ptx.pack_bf16x2

        @cuda.jit
        def kern(x, out):
            i = cuda.grid(1)
            if i < out.size:
                out[i] = fn(x[2 * i], x[2 * i + 1])
        out = np.zeros(len(x) // 2, np.uint32)
        launch_(kern, (len(out) + 127) // 128, 128, x, out)
        if kind == "f16":
            ref = x.astype(np.float16).view(np.uint16)
        else:
            ref = bf16_bits(x)
        got = np.stack([out & 0xFFFF, out >> 16], axis=1).reshape(-1).astype(np.uint16)
        bad = int((got != ref).sum())
        return bad == 0, f"{bad} of {len(x)} halves differ (low half = first arg)"

    case("ptx.pack_f16x2 (cvt.rn.f16x2.f32)", lambda: pack_check("f16"))
    case("ptx.pack_bf16x2 (cvt.rn.bf16x2.f32)", lambda: pack_check("bf16"))

    def ex2_check():
        x = np.concatenate([np.linspace(-30, 10, 4000), [-np.inf, 0.0]]).astype(np.float32)

        @cuda.jit
        def kern(x, out):
            i = cuda.grid(1)
            if i < x.size:
                out[i] = ptx.ex2(x[i])
        out = np.zeros_like(x)
        launch_(kern, (len(x) + 127) // 128, 128, x, out)
        ref = np.exp2(x.astype(np.float64))
        rel = np.abs(out - ref) / np.maximum(ref, 1e-30)
        ok = float(rel[:-2].max()) < 1e-5 and out[-2] == 0 and out[-1] == 1
        return ok, f"max rel err {float(rel[:-2].max()):.2e}, ex2(-inf)={out[-2]}, ex2(0)={out[-1]}"

    case("ptx.ex2 (ex2.approx.ftz.f32)", ex2_check)

    def ldmatrix_check(trans):
        # a 16 x 16 b16 matrix in shared memory (rows padded to 24 halves = 12 words)
        M = np.arange(256, dtype=np.uint16).reshape(16, 16) + 1000
        words = np.zeros(16 * 12, np.uint32)
        for r in range(16):
            for w in range(8):
                words[r * 12 + w] = int(M[r, 2 * w]) | (int(M[r, 2 * w + 1]) << 16)
        fn = ptx.ldmatrix_x4_trans if trans else ptx.ldmatrix_x4

        @cuda.jit
        def kern(src, out):
            sm = cuda.shared.array(192, uint32)
            t = cuda.threadIdx.x
            for i in range(t, 192, 32):
                sm[i] = src[i]
            cuda.syncthreads()
            # matrix i = (rows 8*(i%2).., cols 8*(i//2)..): lane l gives row l%8 of matrix l//8
            mi = t // 8
            row = (mi % 2) * 8 + t % 8
            col_words = (mi // 2) * 4
            r = fn(ptx.shared_addr(sm, row * 12 + col_words))
            out[t, 0] = r[0]
            out[t, 1] = r[1]
            out[t, 2] = r[2]
            out[t, 3] = r[3]
        out = np.zeros((32, 4), np.uint32)
        launch_(kern, 1, 32, words, out)
        bad = 0
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i in range(4):
                sub = M[(i % 2) * 8:(i % 2) * 8 + 8, (i // 2) * 8:(i // 2) * 8 + 8]
                if trans:
                    lo, hi = sub[2 * t, g], sub[2 * t + 1, g]
                else:
                    lo, hi = sub[g, 2 * t], sub[g, 2 * t + 1]
                bad += int(out[lane, i]) != (int(lo) | (int(hi) << 16))
        return bad == 0, f"{bad} of 128 registers differ"

    case("ptx.ldmatrix_x4 + shared_addr", lambda: ldmatrix_check(False))
    case("ptx.ldmatrix_x4_trans", lambda: ldmatrix_check(True))

    def cp_async_check():
        src = (np.arange(8 * 24, dtype=np.uint16) + 7).reshape(8, 24)

        @cuda.jit
        def kern(src, out):
            sm = cuda.shared.array(128, uint32)
            t = cuda.threadIdx.x  # 32 threads: row t // 4, 16-byte chunk t % 4
            r = t // 4
            c = (t % 4) * 8
            n = 16 if c < 24 else 0   # chunk 3 of each row: zero-filled
            cc = c if c < 24 else 0
            ptx.cp_async_16(ptx.shared_addr(sm, r * 16 + c // 2), ptx.global_addr2(src, r, cc), n)
            ptx.cp_async_commit()
            ptx.cp_async_wait_0()
            cuda.syncthreads()
            for i in range(t, 128, 32):
                out[i] = sm[i]
        out = np.full(128, 0xDEADBEEF, np.uint32)
        launch_(kern, 1, 32, src, out)
        got = out.view(np.uint16).reshape(8, 32)
        ref = np.zeros((8, 32), np.uint16)
        ref[:, :24] = src
        bad = int((got != ref).sum())
        return bad == 0, f"{bad} of 256 halves differ (incl. zero-fill)"

    case("ptx.cp_async_16 + commit + wait_group 0 + global_addr2", cp_async_check)


# ----------------------------------------------------------------------------- kernel helpers

def problem_for(q, k, v, causal=False, layout="bhsd", out=None):
    from numflash.inputs import normalize
    from numflash import plan
    p = normalize(q, k, v, causal=causal, layout=layout, out=out)
    return p, plan._cuda_device(p)


def random_qkv(cp, rng, shape, layout, dtype):
    """Standard-normal q, k, v on the GPU for shape (B, H, Nq, Nk, d, dv) in either layout."""
    B, H, Nq, Nk, d, dv = shape
    shapes = ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv))
    if layout == "bshd":
        shapes = tuple((s[0], s[2], s[1], s[3]) for s in shapes)
    return tuple(cp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes)


def make(cp, rng, shape, dtype="float16"):
    return cp.asarray(rng.standard_normal(shape).astype(dtype))


def run_cfg(p, dev, **over):
    from numflash.cuda import mma
    cfg = mma.config(p, dev)
    cfg.update(over)
    lse = mma.run(p, cfg, dev)
    return cfg, lse


def s_stage():
    import cupy as cp
    from numflash.cuda import mma
    rng = np.random.default_rng(1)

    def one(Nq, Nk, d, causal, vec, nw=4, bc=64):
        B, H = 1, 2
        q, k, v = (make(cp, rng, (B, H, n, d)) for n in (Nq, Nk, Nk))
        p, dev = problem_for(q, k, v, causal=causal)
        cfg = mma.config(p, dev)
        cfg.update(VEC=vec, DBG=1, NW=nw, BC=bc)
        dbg = cp.full((B, H, Nq, cfg["BC"]), np.nan, dtype=cp.float32)
        mma.run(p, cfg, dev, debug=dbg)
        got = dbg.get()
        qh, kh = q.get().astype(np.float64), k.get().astype(np.float64)
        S = np.einsum("bhid,bhjd->bhij", qh, kh[:, :, :cfg["BC"]])
        ncol = min(cfg["BC"], Nk)
        ref = np.full(got.shape, -np.inf)
        ref[..., :ncol] = S[..., :ncol]
        if causal:
            i = np.arange(Nq)[:, None]
            j = np.arange(cfg["BC"])[None, :]
            ref[..., j > i + p.causal_offset] = -np.inf
        fin = np.isfinite(ref)
        same_inf = bool(np.array_equal(np.isneginf(got), ~fin))
        err = float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0
        nan = int(np.isnan(got).sum())
        ok = same_inf and err < 2e-2 * math.sqrt(d) and nan == 0
        hint = ""
        if not ok and fin.any():
            # which fragment positions are wrong: rows mod 16, cols mod 8
            bad = np.zeros((16, 8), int)
            diff = np.where(fin, np.abs(np.nan_to_num(got, neginf=0) - np.where(fin, ref, 0)),
                            0) > 2e-2 * math.sqrt(d)
            for r in range(min(Nq, 64)):
                for c in range(cfg["BC"]):
                    bad[r % 16, c % 8] += int(diff[0, 0, r, c])
            hint = f" bad (row%16, col%8) counts:\n{bad}"
        return ok, f"max err {err:.2e}, -inf pattern ok={same_inf}, nan={nan}{hint}"

    for vec in (0, 1):
        case(f"S stage d=64 Nq=Nk=128 VEC={vec}", lambda vec=vec: one(128, 128, 64, False, vec))
        case(f"S stage d=128 Nq=70 Nk=50 causal VEC={vec}",
             lambda vec=vec: one(70, 50, 128, True, vec))
    case("S stage d=32 Nq=Nk=64 causal VEC=1 NW=8", lambda: one(64, 64, 32, True, 1, nw=8))
    case("S stage d=256 Nq=Nk=64 VEC=1 BC=32", lambda: one(64, 64, 256, False, 1, bc=32))


def cases():
    import cupy as cp
    import numflash
    from numflash.testing import check
    rng = np.random.default_rng(2)

    def sample_rows(nq):
        if nq <= 512:
            return None
        return np.unique(np.r_[0:16, nq - 16:nq, rng.choice(nq, 160, replace=False)])

    def one(B, H, Nq, Nk, d, dv, causal=False, layout="bhsd", strided=False, over=None,
            use_out=False):
        shp = (lambda n, e: (B, H, n, e)) if layout == "bhsd" else (lambda n, e: (B, n, H, e))
        if strided:  # last axis strided -> the scalar staging path (VEC=0)
            q = make(cp, rng, shp(Nq, 2 * d))[..., ::2]
        else:
            q = make(cp, rng, shp(Nq, d))
        k, v = make(cp, rng, shp(Nk, d)), make(cp, rng, shp(Nk, dv))
        out = cp.full(shp(Nq, dv), np.nan, dtype=cp.float16) if use_out else None
        if over:
            p, dev = problem_for(q, k, v, causal=causal, layout=layout, out=out)
            cfg, lse = run_cfg(p, dev, **over)
            res = p.result
        else:
            plan = numflash.explain(q, k, v, causal=causal, layout=layout, algorithm="mma")
            cfg = plan.config
            res, lse = numflash.attention(q, k, v, causal=causal, layout=layout,
                                          algorithm="mma", return_lse=True, out=out)
        cp.cuda.runtime.deviceSynchronize()
        rep = check(res, q, k, v, lse=lse, causal=causal, layout=layout, rows=sample_rows(Nq))
        tag = " ".join(f"{x}={cfg[x]}" for x in ("D", "DV", "NW", "BC", "HOLDQ", "VEC"))
        return rep.ok, f"{rep} [{tag}]"

    C = [  # (B, H, Nq, Nk, d, dv, causal, layout, strided, over, use_out)
        (1, 1, 64, 64, 64, 64, False, "bhsd", False, None, False),
        (1, 1, 64, 64, 64, 64, False, "bhsd", False, {"VEC": 0}, False),
        (2, 3, 128, 128, 64, 64, True, "bhsd", False, None, False),
        (2, 3, 128, 128, 64, 64, True, "bhsd", False, {"VEC": 0}, False),
        (1, 2, 1, 1, 64, 64, False, "bhsd", False, None, False),
        (1, 2, 1025, 1025, 64, 64, False, "bhsd", False, None, False),
        (1, 2, 1025, 1025, 64, 64, True, "bhsd", False, None, False),
        (1, 2, 300, 777, 32, 32, "bottom_right", "bhsd", False, None, False),
        (1, 2, 777, 300, 32, 32, "bottom_right", "bhsd", False, None, False),
        (1, 2, 777, 300, 96, 96, True, "bhsd", False, None, False),
        (2, 2, 513, 513, 128, 128, False, "bhsd", False, None, False),
        (2, 2, 513, 513, 128, 128, True, "bhsd", False, {"VEC": 0}, False),
        (1, 2, 257, 300, 256, 256, False, "bhsd", False, None, False),
        (1, 2, 257, 300, 256, 256, True, "bhsd", False, {"VEC": 0}, False),
        (2, 3, 200, 333, 59, 111, True, "bhsd", False, None, False),
        (2, 3, 300, 300, 64, 64, True, "bshd", False, None, True),
        (2, 3, 300, 300, 64, 64, True, "bshd", True, None, False),
        (1, 2, 256, 256, 64, 64, False, "bhsd", False, {"NW": 8}, False),
        (1, 2, 256, 256, 64, 64, True, "bhsd", False, {"NW": 8, "BC": 128}, False),
        (1, 2, 256, 256, 128, 128, True, "bhsd", False, {"NW": 8, "BC": 32}, False),
        (1, 4, 4096, 4096, 64, 64, True, "bhsd", False, None, False),
        (1, 2, 16384, 16384, 64, 64, False, "bhsd", False, None, False),
    ]
    for c in C:
        B, H, Nq, Nk, d, dv, causal, layout, strided, over, use_out = c
        name = (f"B{B} H{H} Nq{Nq} Nk{Nk} d{d} dv{dv} causal={causal} {layout}"
                f"{' strided' if strided else ''}{' out=' if use_out else ''}"
                f"{' ' + str(over) if over else ''}")
        case(name, lambda a=(B, H, Nq, Nk, d, dv, causal, layout, strided, over, use_out): one(*a))


def bf16():
    import cupy as cp
    from numflash import reference
    from numflash.cuda import mma
    rng = np.random.default_rng(3)

    def one(B, H, Nq, Nk, d, causal, vec):
        q32, k32, v32 = (rng.standard_normal((B, H, n, d)).astype(np.float32)
                         for n in (Nq, Nk, Nk))
        qb, kb, vb = bf16_bits(q32), bf16_bits(k32), bf16_bits(v32)
        qh, kh, vh = (bf16_value(x).astype(np.float64) for x in (qb, kb, vb))
        # a float16 problem of the right shape, its arrays swapped for the bf16 bits
        f16 = [cp.asarray(x.astype(np.float16)) for x in (q32, k32, v32)]
        p, dev = problem_for(*f16, causal=causal)
        out = cp.zeros((B, H, Nq, d), dtype=cp.uint16)
        p = dataclasses.replace(p, q=cp.asarray(qb), k=cp.asarray(kb), v=cp.asarray(vb), out=out)
        cfg = mma.config(p, dev)
        cfg.update(DT="bf16", VEC=vec)
        lse = mma.run(p, cfg, dev)
        got = bf16_value(out.get()).astype(np.float64)
        ref, ref_lse = reference.naive(qh, kh, vh, scale=p.scale, causal=p.causal,
                                       causal_offset=p.causal_offset)
        rounding = float(np.abs(bf16_value(bf16_bits(ref.astype(np.float32))) - ref).max())
        err = float(np.abs(got - ref).max())
        bound = 2 * rounding + 2e-3 * 4
        lh = lse.get()
        fin = np.isfinite(ref_lse)
        lse_ok = bool(np.array_equal(np.isneginf(lh), ~fin)) and bool(
            np.allclose(lh[fin], ref_lse[fin], rtol=1e-4, atol=1e-4))
        return err <= bound and lse_ok, f"max err {err:.3g} (bound {bound:.3g}) lse_ok={lse_ok}"

    case("bf16 bits B1 H2 N200 d64 VEC=1", lambda: one(1, 2, 200, 200, 64, False, 1))
    case("bf16 bits B1 H2 N200 d64 causal VEC=0", lambda: one(1, 2, 200, 200, 64, True, 0))
    case("bf16 bits B1 H2 Nq300 Nk100 d128 causal VEC=1", lambda: one(1, 2, 300, 100, 128, True, 1))

    def public_api():
        import numflash
        from numflash.testing import check
        made, how = None, []
        try:
            import ml_dtypes
            x = cp.asarray(rng.standard_normal((1, 2, 150, 64)).astype(np.float32))
            made = (x.astype(ml_dtypes.bfloat16), x.astype(ml_dtypes.bfloat16),
                    x.astype(ml_dtypes.bfloat16))
            how.append("cupy+ml_dtypes")
        except Exception as e:  # noqa: BLE001
            how.append(f"cupy+ml_dtypes: {type(e).__name__}: {str(e)[:80]}")
        if made is None:
            try:
                import torch
                t = [torch.randn(1, 2, 150, 64, device="cuda", dtype=torch.bfloat16)
                     for _ in range(3)]
                made = tuple(cp.from_dlpack(x) for x in t)
                how.append("torch->cupy.from_dlpack")
            except Exception as e:  # noqa: BLE001
                how.append(f"torch dlpack: {type(e).__name__}: {str(e)[:80]}")
        if made is None:
            return True, "SKIPPED (no way to hold bf16 in CuPy here): " + "; ".join(how)
        out, lse = numflash.attention(*made, causal=True, algorithm="mma", return_lse=True)
        rep = check(out, *made, lse=lse, causal=True)
        return rep.ok, f"{'; '.join(how)}: {rep}"

    case("bf16 via the public API", public_api)


# ----------------------------------------------------------------------------- timing

def timing():
    import cupy as cp
    from numflash.cuda import mma
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001
        torch = None

    def bench(fn, reps=10):
        for _ in range(2):
            fn()
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b))
        return float(np.median(ts))

    rows = []
    B, H, N = 4, 16, 4096
    for d in (64, 128):
        rng = np.random.default_rng(4)
        q, k, v = (make(cp, rng, (B, H, N, d)) for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * H * N * N * d / (2 if causal else 1)
            row = {"d": d, "causal": causal}

            def tf(ms):
                return f"{ms:7.3f} ({flops / ms / 1e9:5.0f})"
            try:
                p, dev = problem_for(q, k, v, causal=causal)
                base = mma.config(p, dev)
                variants = [("mma", {})]
                if d == 64:
                    variants += [("NW8", {"NW": 8}), ("NW8 BC128", {"NW": 8, "BC": 128}),
                                 ("BC128", {"BC": 128})]
                else:
                    variants += [("NW8", {"NW": 8}), ("NW8 BC32", {"NW": 8, "BC": 32})]
                variants += [("VEC0", {"VEC": 0})]
                for name, over in variants:
                    try:
                        cfg = dict(base, **over)
                        if mma.smem_bytes(cfg) > dev.smem_per_block_optin:
                            row[name] = "smem"
                            continue
                        ms = bench(lambda cfg=cfg: mma.run(p, cfg, dev))
                        row[name] = tf(ms)
                    except Exception as e:  # noqa: BLE001
                        row[name] = "ERR " + short_tb(e)[:120]
            except Exception as e:  # noqa: BLE001
                row["mma"] = "ERR " + short_tb(e)[:160]
            try:
                def naive():
                    s = cp.matmul(q, k.transpose(0, 1, 3, 2)).astype(cp.float32) / math.sqrt(d)
                    if causal:
                        s += cp.triu(cp.full((N, N), -cp.inf, cp.float32), 1)
                    s = cp.exp(s - s.max(-1, keepdims=True))
                    s /= s.sum(-1, keepdims=True)
                    return cp.matmul(s.astype(cp.float16), v)
                row["cupy naive"] = tf(bench(naive, reps=3))
            except Exception as e:  # noqa: BLE001
                row["cupy naive"] = "ERR " + short_tb(e)[:80]
            if torch is not None:
                try:
                    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

                    def sdpa():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    sdpa()
                    torch.cuda.synchronize()
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    ts = []
                    for _ in range(10):
                        a.record()
                        sdpa()
                        b.record()
                        b.synchronize()
                        ts.append(a.elapsed_time(b))
                    row["SDPA flash"] = tf(float(np.median(ts)))
                except Exception as e:  # noqa: BLE001
                    row["SDPA flash"] = "ERR " + short_tb(e)[:80]
            rows.append(row)
            print(f"TIME B{B} H{H} N{N} d{d} causal={causal}: " +
                  " | ".join(f"{kk}: {vv}" for kk, vv in row.items() if kk not in ("d", "causal")),
                  flush=True)
    print("(ms, TFLOP/s in brackets; CUDA events, median of 10 after 2 warm-up runs; "
          "cupy naive median of 3)")
    try:
        # registers/spills of the configs timed above
        from numflash.cuda import launch
        for kern in launch._kernels.values():
            if kern.name == mma.NAME:
                for entry in kern._loaded.values():
                    meta = getattr(entry, "meta", None) or (entry[1] if isinstance(entry, tuple)
                                                             else {})
                    print("BUILD", kern.config, meta.get("resources"))
    except Exception as e:  # noqa: BLE001
        print("BUILD info unavailable:", short_tb(e))


# ----------------------------------------------------------------------------- tf32

def tf32_bits_np(x):
    """cvt.rna.tf32.f32 in numpy: round to nearest (ties away from zero) to a 10-bit mantissa."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32)


def tf32():
    """precision="tf32": the two intrinsics alone, float32 through the kernel against the float64
    reference (tf32 bound: rel err < 5e-3, lse within 1e-2), and a timing line vs cuda.block.
    With MMA_PROBE_COMPILE_ONLY=1 (no GPU) only the two intrinsic kernels are compiled."""
    import numflash
    from numba import cuda
    from numflash.cuda import ptx
    from numflash.reference import attention as ref_attention
    from numflash.testing import check
    rng = np.random.default_rng(7)

    def cvt_check():
        x = np.r_[rng.standard_normal(4093).astype(np.float32), 1 + 2.0 ** -11, -(1 + 2.0 ** -11),
                  1 + 3 * 2.0 ** -11].astype(np.float32)

        @cuda.jit
        def kern(a, out):
            i = cuda.grid(1)
            if i < a.size:
                out[i] = ptx.to_tf32(a[i])
        out = np.zeros(x.size, np.uint32)
        launch_(kern, (x.size + 127) // 128, 128, x, out)
        bad = int((out != tf32_bits_np(x)).sum())
        return bad == 0, f"{bad} of {x.size} differ from numpy round-half-away"

    def mma_check():
        A = rng.standard_normal((16, 8)).astype(np.float32)
        Bm = rng.standard_normal((8, 8)).astype(np.float32)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        Ab, Bb = tf32_bits_np(A), tf32_bits_np(Bm)
        D = run_mma_16x8x8(ptx.mma_tf32, Ab, Bb, C)
        ref = Ab.view(np.float32).astype(np.float64) @ Bb.view(np.float32).astype(np.float64) + C
        err = float(np.abs(D - ref).max())
        return err < 1e-4, f"max abs err {err:.2e} (vs tf32-rounded operands)"

    case("ptx.to_tf32 (cvt.rna.tf32.f32) bits vs numpy", cvt_check)
    case("ptx.mma_tf32 (m16n8k8, C added)", mma_check)
    if COMPILE_ONLY:
        return
    import cupy as cp

    def one(B, H, Nq, Nk, d, dv, causal, layout="bhsd"):
        q, k, v = random_qkv(cp, rng, (B, H, Nq, Nk, d, dv), layout, np.float32)
        plan = numflash.explain(q, k, v, causal=causal, layout=layout, precision="tf32")
        if plan.kernel != "cuda.mma" or plan.config.get("DT") != "tf32":
            return False, f"plan is not cuda.mma tf32: {plan}"
        out, lse = numflash.attention(q, k, v, causal=causal, layout=layout, precision="tf32",
                                      return_lse=True)
        rep = check(out, q, k, v, causal=causal, layout=layout)
        _, ref_lse = ref_attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        lh = lse.get()
        inf = np.isneginf(ref_lse)
        lse_err = float(np.abs(lh[~inf] - ref_lse[~inf]).max()) if (~inf).any() else 0.0
        lse_ok = bool(np.array_equal(np.isneginf(lh), inf)) and lse_err < 1e-2
        ok = rep.finite and rep.rel_err < 5e-3 and lse_ok and out.dtype == cp.float32
        return ok, (f"rel err {rep.rel_err:.2e} (bound 5e-3) max err {rep.max_err:.2e} "
                    f"lse err {lse_err:.1e} finite={rep.finite}")

    for args in [(1, 1, 1, 1, 64, 64, False), (2, 3, 128, 128, 64, 64, False),
                 (2, 3, 300, 777, 64, 64, True), (1, 2, 777, 300, 128, 128, True),
                 (1, 2, 777, 300, 128, 128, "bottom_right"), (2, 2, 1025, 1025, 128, 128, False),
                 (2, 3, 200, 333, 59, 111, True), (1, 2, 257, 300, 32, 96, False),
                 (1, 2, 4096, 4096, 64, 64, True)]:
        B, H, Nq, Nk, d, dv, causal = args
        case(f"tf32 B{B} H{H} Nq{Nq} Nk{Nk} d{d} dv{dv} causal={causal}",
             lambda a=args: one(*a))
    case("tf32 bshd B2 N300 H3 d64 causal", lambda: one(2, 3, 300, 300, 64, 64, True, "bshd"))

    def timing_line():
        B, H, N, d = 4, 16, 4096, 64
        q, k, v = (cp.asarray(rng.standard_normal((B, H, N, d)).astype(np.float32))
                   for _ in range(3))

        def ms(**kw):
            numflash.attention(q, k, v, **kw)
            ts = []
            for _ in range(5):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                numflash.attention(q, k, v, **kw)
                b.record()
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b))
            return float(np.median(ts))
        parts = []
        for causal in (False, True):
            flops = 4 * B * H * N * N * d / (2 if causal else 1)
            t_tf32 = ms(causal=causal, precision="tf32")
            t_block = ms(causal=causal, algorithm="block")
            parts.append(f"causal={causal}: tf32 mma {t_tf32:.2f} ms ({flops / t_tf32 / 1e9:.0f} "
                         f"TFLOP/s) vs fp32 block {t_block:.2f} ms ({flops / t_block / 1e9:.0f}), "
                         f"{t_block / t_tf32:.1f}x")
        print(f"TIME tf32 B{B} H{H} N{N} d{d}: " + "; ".join(parts), flush=True)
        return True, "see TIME line"

    case("tf32 timing vs cuda.block fp32", timing_line)


def run_mma_fragments(intrinsic, af, bf, cf, cc=(8, 0)):
    """Run one warp-wide mma intrinsic on per-lane fragments (af: 32 x 4 A registers, bf: 32 x 2
    B registers, cf: 32 x 4 C values) and return D as the 16 x 8 matrix of the C/D layout
    (lane 4g + t holds D[g, 2t], D[g, 2t+1], D[g+8, 2t], D[g+8, 2t+1])."""
    from numba import cuda

    @cuda.jit
    def kern(a, b, c, out):
        t = cuda.threadIdx.x
        r = intrinsic(a[t, 0], a[t, 1], a[t, 2], a[t, 3], b[t, 0], b[t, 1],
                      c[t, 0], c[t, 1], c[t, 2], c[t, 3])
        out[t, 0] = r[0]
        out[t, 1] = r[1]
        out[t, 2] = r[2]
        out[t, 3] = r[3]
    out = np.zeros((32, 4), cf.dtype)
    launch_(kern, 1, 32, af, bf, cf, out, cc=cc)
    D = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = out[lane]
    return D


def c_fragments(C):
    """The 32 x 4 per-lane C registers of a 16 x 8 matrix (see run_mma_fragments)."""
    cf = np.zeros((32, 4), C.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        cf[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return cf


def run_mma_16x8x8(intrinsic, A, Bm, C, cc=(8, 0)):
    """D = A @ Bm + C through a 16x8x8 mma intrinsic (mma_tf32 / mma_f64_*), fragments laid out
    as the PTX ISA says (lane 4g + t: a = A[g|g+8, t|t+4], b = B[t|t+4, g])."""
    af, bf = np.zeros((32, 4), A.dtype), np.zeros((32, 2), Bm.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        af[lane] = [A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4]]
        bf[lane] = [Bm[t, g], Bm[t + 4, g]]
    return run_mma_fragments(intrinsic, af, bf, c_fragments(C), cc)


def gpu_ms(fn, reps=10, warmup=2):
    """Median milliseconds of fn() by CUDA events, after warm-up."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))


def f64_cfgs(D, cc=(9, 0)):
    """The float64 tile variants the f64 section times (the first is the default for contiguous
    inputs, the second the scalar-staging default for strided ones)."""
    from numflash.cuda import mma
    nw, bc, holdq = mma._tile(D, D, "f64")
    base = {"D": D, "DV": D, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "f64", "VEC": 1,
            "MMA": "m16n8k8" if cc >= (9, 0) else "m8n8k4"}
    out = [base, dict(base, VEC=0)]
    if base["MMA"] == "m16n8k8":
        out.append(dict(base, MMA="m8n8k4"))
    for nw_, bc_, hq_ in ((4, 32, 1), (8, 32, 1), (4, 64, 0), (8, 64, 0), (4, 16, 0),
                          (4, 32, 0), (8, 16, 0), (8, 32, 0)):
        if (D <= 64) == bool(hq_ or bc_ == 64) and (nw_, bc_, hq_) != (nw, bc, holdq):
            out.append(dict(base, NW=nw_, BC=bc_, HOLDQ=hq_))
    return out


def f64():
    """float64 on float64 tensor cores: both mma_f64 forms alone (exact to rounding), the kernel
    through the public API against the float64 reference with the test suite's accuracy rule,
    and tile variants timed against CuPy naive float64 (plain and in-place softmax) and
    cuda.block at B=4 H=16 N=4096, d=64/128, causal or not."""
    from numflash.cuda import ptx
    rng = np.random.default_rng(11)

    def mma_check(intrinsic, cc):
        A, Bm, C = (rng.standard_normal(s) for s in ((16, 8), (8, 8), (16, 8)))
        D = run_mma_16x8x8(intrinsic, A, Bm, C, cc=cc)
        err = float(np.abs(D - (A @ Bm + C)).max())
        return err < 1e-13, f"max abs err {err:.1e}"

    case("ptx.mma_f64_m16n8k8 (sm_90 native)", lambda: mma_check(ptx.mma_f64_m16n8k8, (9, 0)))
    case("ptx.mma_f64_m8n8k4x4 (4x m8n8k4)", lambda: mma_check(ptx.mma_f64_m8n8k4x4, (8, 0)))
    if COMPILE_ONLY:
        return
    import cupy as cp
    import numflash
    from numflash.bench import naive_attention, plain_naive_attention, causal_hidden
    from numflash.testing import check
    from numflash.cuda import mma

    def one(B, H, Nq, Nk, d, dv, causal, layout="bhsd"):
        q, k, v = random_qkv(cp, rng, (B, H, Nq, Nk, d, dv), layout, np.float64)
        plan = numflash.explain(q, k, v, causal=causal, layout=layout)
        if plan.kernel != "cuda.mma" or plan.config.get("DT") != "f64":
            why = plan.rejected.get("cuda.mma", "")  # d > 64 on sm_80-89, small shared memory
            if "head dims up to" not in why and "shared memory" not in why:
                return False, f"plan is not cuda.mma f64: {plan}"
        out, lse = numflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        rep = check(out, q, k, v, lse=lse, causal=causal, layout=layout)
        return rep.ok and out.dtype == cp.float64, str(rep)

    for args in [(1, 1, 1, 1, 64, 64, False), (2, 3, 128, 128, 64, 64, False),
                 (2, 3, 300, 777, 64, 64, True), (1, 2, 777, 300, 128, 128, "bottom_right"),
                 (2, 2, 1025, 1025, 128, 128, False), (2, 3, 200, 333, 59, 111, True),
                 (1, 2, 97, 1025, 1, 8, False), (1, 2, 4096, 4096, 64, 64, True)]:
        case("f64 B{} H{} Nq{} Nk{} d{} dv{} causal={}".format(*args), lambda a=args: one(*a))
    case("f64 bshd B2 N300 H3 d64 causal", lambda: one(2, 3, 300, 300, 64, 64, True, "bshd"))

    def timing(d):
        from numflash.inputs import normalize
        from numflash import plan as plan_mod
        B, H, N = 4, 16, 4096
        q, k, v = (cp.asarray(rng.standard_normal((B, H, N, d))) for _ in range(3))
        lines = []
        for causal in (False, True):
            flops = 4 * B * H * N * N * d / (2 if causal else 1)
            hidden = causal_hidden(cp, N, N) if causal else None
            scale = 1 / math.sqrt(d)
            t = {"naive-plain": gpu_ms(lambda: plain_naive_attention(cp, q, k, v, scale, hidden),
                                       reps=5),
                 "naive": gpu_ms(lambda: naive_attention(cp, q, k, v, scale, hidden), reps=5),
                 "block": gpu_ms(lambda: numflash.attention(q, k, v, causal=causal,
                                                            algorithm="block"), reps=5)}
            p = normalize(q, k, v, causal=causal)
            dev = plan_mod._cuda_device(p)
            for cfg in f64_cfgs(d, dev.cc):
                if mma.smem_bytes(cfg) > dev.smem_per_block_optin:
                    continue
                name = "mma " + " ".join(f"{k}={cfg[k]}" for k in ("NW", "BC", "HOLDQ", "VEC",
                                                                     "MMA"))
                t[name] = gpu_ms(lambda c=cfg: mma.run(p, c, dev), reps=5)
            out = numflash.attention(q, k, v, causal=causal)
            rep = check(out, q, k, v, causal=causal, rows=np.arange(0, N, 61))
            best = min((v_, k_) for k_, v_ in t.items() if k_.startswith("mma"))
            lines.append(f"TIME f64 B{B} H{H} N{N} d{d} causal={causal} (auto out ok={rep.ok}): "
                         + "; ".join(f"{k_} {v_:.2f} ms ({flops / v_ / 1e9:.1f})"
                                     for k_, v_ in t.items())
                         + f" | best {best[1]}: {t['naive-plain'] / best[0]:.2f}x plain naive, "
                         f"{t['naive'] / best[0]:.2f}x naive, {t['block'] / best[0]:.2f}x block")
            if not rep.ok:
                return False, str(rep)
        for line in lines:
            print(line, flush=True)
        return True, "see TIME lines"

    for d in (64, 128):
        case(f"f64 timing d{d}", lambda d=d: timing(d))


def x3_cfgs(D):
    """3xTF32 tile variants (NW, BC, HOLDQ) the x3 section times; the first is the default."""
    from numflash.cuda import mma
    nw, bc, holdq = mma._tile(D, D, "3xtf32", 227 * 1024, 1, (9, 0))
    base = {"D": D, "DV": D, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "3xtf32", "VEC": 1}
    tiles = ((8, 64, 1), (4, 64, 1), (8, 32, 1), (4, 32, 1)) if D <= 64 else \
        ((8, 32, 0), (4, 32, 0), (8, 16, 0), (4, 64, 0))
    return [base, dict(base, VEC=0)] + [dict(base, NW=a, BC=b, HOLDQ=c) for a, b, c in tiles]


def x3_prewarm_cfgs():
    """x3_cfgs and the defaults tests/test_cuda_3xtf32.py and test_cuda_gpu.py meet on the GPU."""
    from numflash.cuda import mma
    cfgs = x3_cfgs(64) + x3_cfgs(128)
    for D, DV in ((32, 32), (32, 96), (96, 64), (64, 128)):
        nw, bc, holdq = mma._tile(D, DV, "3xtf32", 227 * 1024, 1, (9, 0))
        cfgs.append({"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "3xtf32",
                     "VEC": 1})
    return cfgs


def mma_rates():
    """Peak rates of mma.sync.m16n8k8 tf32 and m16n8k16 f16 (fp32 accumulators) on this GPU: per
    warp 8 independent accumulator chains on distinct operand registers, 8 warps a block, 4
    blocks per SM; TFLOP/s counted as 2*M*N*K per mma."""
    import cupy as cp
    from numba import cuda
    from numflash.cuda import ptx
    ITER = 2048
    lines = []
    to_bits = cuda.jit(device=True)(lambda x: x)
    for name, mma, conv, k, a in (
            ("tf32 m16n8k8", ptx.mma_tf32, ptx.to_tf32, 8, cp.full(64, 1e-3, np.float32)),
            ("f16 m16n8k16", ptx.mma_f16, to_bits, 16, cp.full(64, 0x14001400, np.uint32))):
        @cuda.jit
        def kern(out, a_in):
            t = cuda.threadIdx.x % 32
            a0, a1, a2, a3 = conv(a_in[t]), conv(a_in[t + 1]), conv(a_in[t + 2]), \
                conv(a_in[t + 3])
            b0, b1 = conv(a_in[t + 4]), conv(a_in[t + 5])
            z = np.float32(0)
            x0 = (z, z, z, z)
            x1 = x2 = x3 = x4 = x5 = x6 = x7 = x0
            for _ in range(ITER):
                x0 = mma(a0, a1, a2, a3, b0, b1, x0[0], x0[1], x0[2], x0[3])
                x1 = mma(a1, a2, a3, a0, b0, b1, x1[0], x1[1], x1[2], x1[3])
                x2 = mma(a2, a3, a0, a1, b0, b1, x2[0], x2[1], x2[2], x2[3])
                x3 = mma(a3, a0, a1, a2, b0, b1, x3[0], x3[1], x3[2], x3[3])
                x4 = mma(a0, a1, a2, a3, b1, b0, x4[0], x4[1], x4[2], x4[3])
                x5 = mma(a1, a2, a3, a0, b1, b0, x5[0], x5[1], x5[2], x5[3])
                x6 = mma(a2, a3, a0, a1, b1, b0, x6[0], x6[1], x6[2], x6[3])
                x7 = mma(a3, a0, a1, a2, b1, b0, x7[0], x7[1], x7[2], x7[3])
            acc = z
            for x in (x0, x1, x2, x3, x4, x5, x6, x7):
                acc += x[0] + x[1] + x[2] + x[3]
            out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = acc
        sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        blocks, threads = 4 * sms, 256
        out = cp.zeros(blocks * threads, np.float32)
        ms = gpu_ms(lambda: kern[blocks, threads](out, a), reps=5)
        flops = 2 * 16 * 8 * k * 8 * ITER * blocks * threads // 32
        lines.append(f"{name} {flops / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)")
    return True, "TIME mma.sync peaks: " + "; ".join(lines)


def x3():
    """float32 as 3xTF32 (cuda.mma DT="3xtf32"): the tf32 mma peak, accuracy of the variants
    against the float64 reference with the exact kernels' rule (every case, both staging paths),
    and the variants timed against cuda.block, CuPy naive (plain) and torch SDPA mem-efficient at
    B=4 H=16 N=4096."""
    if COMPILE_ONLY:
        return
    case("mma.sync rates", mma_rates)
    import cupy as cp
    import numflash
    from numflash.bench import plain_naive_attention
    from numflash.cuda import mma
    from numflash.testing import check
    rng = np.random.default_rng(12)
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001
        torch = None

    def accuracy(B, H, Nq, Nk, d, causal):
        q, k, v = random_qkv(cp, rng, (B, H, Nq, Nk, d, d), "bhsd", np.float32)
        p, dev = problem_for(q, k, v, causal=causal)
        reps = []
        for cfg in x3_cfgs(mma.head_dim_pad(d))[:3]:
            if cfg["VEC"] and mma.vector_ok(p):
                continue
            p.out[...] = cp.nan
            mma.run(p, cfg, dev)
            rows = None if Nq <= 1025 else np.arange(0, Nq, 37)
            rep = check(p.out, q, k, v, causal=causal, rows=rows)
            if not rep.ok:
                return False, f"{cfg}: {rep}"
            reps.append(f"max {rep.max_err:.1e} (bound {rep.bound:.1e})")
        return True, "; ".join(reps)

    for args in [(1, 1, 1, 1, 64, False), (2, 3, 300, 777, 64, True), (1, 2, 777, 300, 128, True),
                 (2, 2, 1025, 1025, 128, False), (2, 3, 200, 333, 59, True),
                 (1, 2, 4096, 4096, 64, False), (1, 2, 4096, 4096, 128, False),
                 (1, 2, 16384, 16384, 128, False)]:
        case("3xtf32 B{} H{} Nq{} Nk{} d{} causal={}".format(*args),
             lambda a=args: accuracy(*a))

    def timing(d):
        B, H, N = 4, 16, 4096
        q, k, v = (cp.asarray(rng.standard_normal((B, H, N, d)).astype(np.float32))
                   for _ in range(3))
        lines = []
        for causal in (False, True):
            flops = 4 * B * H * N * N * d / (2 if causal else 1)
            t = {"block": gpu_ms(lambda: numflash.attention(q, k, v, causal=causal,
                                                            algorithm="block"), reps=5)}
            if not causal:
                t["naive-plain"] = gpu_ms(lambda: plain_naive_attention(
                    cp, q, k, v, 1 / math.sqrt(d)), reps=5)
            if torch is not None:
                tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    t["sdpa-eff"] = gpu_ms(lambda: F.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal), reps=5)
            p, dev = problem_for(q, k, v, causal=causal)
            for cfg in x3_cfgs(d):
                if mma.smem_bytes(cfg) > dev.smem_per_block_optin:
                    continue
                name = "x3 " + " ".join(f"{k_}={cfg[k_]}" for k_ in ("NW", "BC", "HOLDQ", "VEC"))
                p.out[...] = cp.nan
                t[name] = gpu_ms(lambda c=cfg: mma.run(p, c, dev), reps=5)
                rep = check(p.out, q, k, v, causal=causal, rows=np.arange(0, N, 97))
                if not rep.ok:
                    return False, f"{name} causal={causal}: {rep}"
            lines.append(f"TIME 3xtf32 B{B} H{H} N{N} d{d} causal={causal}: "
                         + "; ".join(f"{k_} {v_:.2f} ms ({flops / v_ / 1e9:.1f})"
                                     for k_, v_ in t.items()))
        for line in lines:
            print(line, flush=True)
        return True, "see TIME lines"

    for d in (64, 128):
        case(f"3xtf32 timing d{d}", lambda d=d: timing(d))


def _build_one(cfg, cc):
    from numba import types
    from numflash.cuda import launch, mma
    elem = {"tf32": types.float32, "3xtf32": types.float32,
            "f64": types.float64}.get(cfg.get("DT"), types.uint16)
    A = types.Array(elem, 4, "A")
    argtypes = (A, A, A, A, types.Array(types.float32, 3, "A"), types.Array(types.float32, 4, "A"),
                types.float64, types.float64, types.int64, types.int64)
    t = time.time()
    _, meta = launch.get_kernel(mma.NAME, mma.make_kernel, cfg).build(argtypes, cc)
    return cfg, meta.get("resources"), meta.get("from_disk"), time.time() - t


def prewarm(cc, sections=None):
    """Compile the variants the sections use in parallel into the disk cache (each takes 5-20 s
    single-threaded; sequentially they would take minutes)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    from numflash.cuda import mma
    cfgs = []
    if sections is None or "tf32" in sections:
        for D, DV in [(32, 96), (64, 128)] + [(D, D) for D in (32, 64, 96, 128)]:
            nw, bc, holdq = mma._tile(D, DV, "tf32")
            cfgs.append({"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "tf32",
                         "VEC": 0})
    if sections is None or "f64" in sections:
        cfgs += f64_cfgs(64, cc) + f64_cfgs(128, cc)
        for D, DV in ((32, 32), (64, 128)):  # the odd head dims of the f64 cases
            nw, bc, holdq = mma._tile(D, DV, "f64")
            cfgs += [{"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "f64",
                      "VEC": vec, "MMA": "m16n8k8" if cc >= (9, 0) else "m8n8k4"}
                     for vec in (0, 1)]
    if sections is None or "x3" in sections:
        cfgs += x3_prewarm_cfgs()
    if sections is None or not set(sections) <= {"tf32", "units", "f64", "x3"}:
        cfgs += _f16_prewarm_cfgs()
    t = time.time()
    with cf.ProcessPoolExecutor(max_workers=min(len(cfgs), os.cpu_count() or 4),
                                mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_build_one, c, cc) for c in cfgs]
        for f in cf.as_completed(futs):
            try:
                cfg, res, disk, dt = f.result()
                print(f"BUILD {cfg} {res} {'(cached)' if disk else f'{dt:.0f}s'}", flush=True)
            except Exception as e:  # noqa: BLE001
                print("BUILD FAIL", short_tb(e), flush=True)
    print(f"prewarm: {len(cfgs)} variants in {time.time() - t:.0f}s", flush=True)


def _f16_prewarm_cfgs():
    from numflash.cuda import mma
    cfgs = []
    for D in mma.HEAD_DIMS:
        nw, bc, holdq = mma._tile(D, D)
        for dt in ("f16", "bf16"):
            for vec in (0, 1):
                base = {"D": D, "DV": D, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": dt, "VEC": vec}
                cfgs.append(base)
                if dt == "f16" and D in (64, 128) and vec == 1:
                    cfgs += [dict(base, NW=8), dict(base, DBG=1)]
                    cfgs += [dict(base, NW=8, BC=128), dict(base, BC=128)] if D == 64 else \
                        [dict(base, NW=8, BC=32)]
    cfgs.append({"D": 64, "DV": 128, "NW": 4, "BC": 64, "HOLDQ": 1, "DT": "f16", "VEC": 0})
    return cfgs


SECTIONS = {"units": units, "s": s_stage, "cases": cases, "bf16": bf16, "time": timing,
            "tf32": tf32, "f64": f64, "x3": x3}


def main(argv):
    chosen = argv or list(SECTIONS)
    try:
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(0)
        import numba_cuda
        print(f"device: {props['name'].decode()} cc {props['major']}.{props['minor']}; "
              f"numpy {np.__version__}, cupy {cp.__version__}, numba-cuda {numba_cuda.__version__}")
    except Exception as e:  # noqa: BLE001
        print("device info:", short_tb(e))
    if any(c != "units" for c in chosen) and os.environ.get("MMA_PROBE_NO_PREWARM") != "1":
        try:
            cc = (int(props["major"]), int(props["minor"]))
            prewarm(cc, chosen)
        except Exception as e:  # noqa: BLE001
            print("prewarm failed (sections compile as they go):", short_tb(e), flush=True)
    for name in chosen:
        print(f"== {name} ==", flush=True)
        try:
            SECTIONS[name]()
        except Exception as e:  # noqa: BLE001
            RESULTS["FAIL"] += 1
            print(f"FAIL section {name}: {short_tb(e)}", flush=True)
    print(f"== done: {RESULTS['PASS']} passed, {RESULTS['FAIL']} failed, "
          f"{time.time() - T0:.0f}s ==")


if __name__ == "__main__":
    main(sys.argv[1:])
