"""FlashAttention-2 forward on tensor cores, compute capability >= 8.0: float16 / bfloat16 on
m16n8k16; float64 on float64 tensor cores (exact IEEE products), and float32 on tf32 tensor cores
as 3xTF32 (float32-level accuracy) or, with precision="tf32", one tf32 mma per product; those
three on a 16x8x8 mma: see ``kernel_source_word``.

A block of NW warps owns BR = 16 NW query rows; each warp owns 16 of them. K and V tiles of BC keys
are staged in shared memory; per tile each warp computes its 16 x BC block of S = Q K^T with
``mma.sync.m16n8k16`` (fp32 accumulators), runs the online softmax on the accumulator fragments in
registers (a thread holds 2 rows; row max/sum over the 4 lanes of a quad by shfl_xor 1, 2), packs
P to f16x2/bf16x2 in registers and feeds it straight back as the A operand of P V (the C layout of
two adjacent n8 tiles is the A layout of one k16 tile), accumulating O in registers. O is
normalized once at the end; lse is written.

Registers: every fragment is a scalar Python variable of generated source (one per register), so
nothing lives in local memory; the kernel source is generated per compile-time config by
``kernel_source`` and compiled by numba like any other kernel (see ``print(kernel_source(...))``).

Shared memory, all 32-bit words holding two 16-bit values (low half = lower index), rows padded by
4 words (16 bytes) so fragment loads and ldmatrix rows are bank-conflict free and 16-byte aligned:
  Q  [BR][D/2 + 4]       (Q is read into registers once when HOLDQ; K/V then reuse its space)
  K  [BC][D/2 + 4]       row-major: a B fragment of Q K^T is one word per register
  V  staged as Vt[DV][BC/2 + 4] (transposed) with scalar loads, so a B fragment of P V is one
     word per register; with cp.async (VEC) as V[BC][DV/2 + 4] read by ldmatrix.trans.

Staging (``VEC``): VEC=1 copies Q/K/V rows with 16-byte ``cp.async`` (K/V of the next tile in
flight while the current one is computed: double buffering) and reads fragments with ``ldmatrix``;
that needs the last axis contiguous, d and dv multiples of 8 and every row 16-byte aligned, which
config() checks. Other inputs (strided last axis, odd d, misaligned views) take VEC=0: plain
16-bit loads staged through registers -- slower, same results.

Masking: keys past Nk and (causal) keys past row + causal_offset get -inf before the row max;
tiles no row of the block can see are never loaded, and warps skip tiles none of their rows see.
A row that sees no key gives zeros and lse = -inf. Head dims are padded (zero-filled) up to the
next of 32, 64, 96, 128, 256.
"""
import contextlib
import linecache
import math

import numpy as np

from ..device import Unsupported
from ..inputs import IEEE_REASON
from .common import key_end

NAME = "cuda.mma"
HEAD_DIMS = (32, 64, 96, 128, 256)


def head_dim_pad(n):
    for size in HEAD_DIMS:
        if n <= size:
            return size
    raise Unsupported(f"{NAME} takes head dims up to {HEAD_DIMS[-1]}; got {n}")


# ------------------------------------------------------------------------------ source generator

class _Src:
    def __init__(self):
        self.lines = []
        self.ind = 0

    def __call__(self, *lines):
        for line in lines:
            self.lines.append("    " * self.ind + line)

    def block(self):
        src = self

        class _B:
            def __enter__(self):
                src.ind += 1

            def __exit__(self, *a):
                src.ind -= 1
        return _B()

    def text(self):
        return "\n".join(self.lines) + "\n"


def U(n):
    """A uint64 constant in generated source (int literals are int64 in numba, and uint64 mixed
    with int64 becomes float64)."""
    return f"U({int(n)})"


def _emit_cp_async_rows(s, src, rows, row, first, limit, width, dim, off, W, chunk, per_word,
                        NT):
    """Emit the 16-byte cp.async copy of rows x width elements of ``src`` (a 2-D global view)
    into shared rows of W words at word offset ``off``: ``chunk`` elements per 16 bytes,
    ``per_word`` elements per shared word. Rows at or past ``limit`` and columns at or past
    ``dim`` are zero-filled (cp.async's src-size 0), so padding needs no second pass."""
    col = "c" if per_word == 1 else f"c // {U(per_word)}"
    s(f"for idx in range(tid, {U(rows * width // chunk)}, {U(NT)}):")
    with s.block():
        s(f"r = idx // {U(width // chunk)}",
          f"c = (idx % {U(width // chunk)}) * {U(chunk)}",
          f"{row} = {first} + r",
          f"n = {U(16)} if {row} < {limit} and c < {dim} else {U(0)}",
          f"src = global_addr2({src}, {row} if {row} < {limit} else {U(0)}, "
          f"c if c < {dim} else {U(0)})",
          f"cp_async_16(shared_addr(smem, {U(off)} + r * {U(W)} + {col}), src, n)")


@contextlib.contextmanager
def _tile_loop(s, stage_kv, BC, kv_words, VEC, KV_OFF, KW):
    """Emit the K/V tile loop's head and enter its body, yielding the word offsets of the tile
    being read (k_off, v_off) and the source prefix of its buffer (kb): VEC double-buffers with
    cp.async; otherwise each tile is staged synchronously between two barriers."""
    s(f"ntiles = (block_keys + {BC - 1}) // {BC}")
    if VEC:
        _emit_double_buffered_loop(s, stage_kv, BC, kv_words)
    else:
        s("for it in range(ntiles):")
    with s.block():
        if VEC:
            yield KV_OFF, KV_OFF + BC * KW, "buf + "
            return
        s(f"j0 = it * {BC}", "j0u = U(j0)")
        s("cuda.syncthreads()  # the previous tile is no longer read")
        k_off, v_off = stage_kv("j0u", 0)
        s("cuda.syncthreads()")
        yield k_off, v_off, ""


def _emit_double_buffered_loop(s, stage_kv, BC, kv_words):
    """Emit the head of the K/V tile loop with cp.async double buffering: tile 0 is put in flight
    before the loop; each iteration starts tile it+1 in the other buffer, then waits for tile it.
    The body that follows reads the tile at word offset ``buf``."""
    s("if ntiles > 0:")
    with s.block():
        stage_kv(U(0), 0)
    s("for it in range(ntiles):")
    with s.block():
        s(f"j0 = it * {BC}")
        s(f"buf = U(it % 2) * {U(kv_words)}")
        s("cuda.syncthreads()  # everyone is done reading the buffer refilled next")
        s("if it + 1 < ntiles:")
        with s.block():
            # generated twice: the buffer offset must be a compile-time constant
            s("if it % 2 == 0:")
            with s.block():
                stage_kv(f"U(j0 + {BC})", 1)
            s("else:")
            with s.block():
                stage_kv(f"U(j0 + {BC})", 0)
            s("cp_async_wait_1()")
        s("else:")
        with s.block():
            s("cp_async_wait_0()")
        s("cuda.syncthreads()")


def _emit_prologue(s, BR, flt, word):
    """Emit the thread / block indices, the per-head views and the shared array (``word``
    elements); the two scales arrive as float64 (launch.py's ABI) and become ``flt``."""
    s(f"scale_log2 = {flt}(scale_log2_in)", f"scale = {flt}(scale_in)",
      "H = q.shape[1]", "Nq = q.shape[2]", "Hkv = k.shape[1]", "Nk = k.shape[2]",
      "Nq_u = U(Nq)", "Nk_u = U(Nk)",
      "d_u = U(q.shape[3])", "dv_u = U(v.shape[3])",
      "tid = U(cuda.threadIdx.x)",
      f"warp = tid // {U(32)}",
      f"lane = tid % {U(32)}",
      f"g = lane // {U(4)}",
      f"t = lane % {U(4)}",
      # last Q block first: under causal masking it is the longest, so the tail is short
      f"qb = U(cuda.gridDim.x) - {U(1)} - U(cuda.blockIdx.x)",
      "bh = U(cuda.blockIdx.y)",
      "b = bh // U(H)",
      "h = bh % U(H)",
      "hk = kv_head(h, U(H), U(Hkv))",
      f"i0 = qb * {U(BR)}",
      "qh = q[b, h]", "kh = k[b, hk]", "vh = v[b, hk]", "oh = out[b, h]",
      f"smem = cuda.shared.array(0, {word})")


def _emit_row_bounds(s, BR):
    """Emit the thread's two rows (r0 = g, r1 = g + 8 of its warp's 16), their key ends e0 / e1,
    and the key counts the warp and the block must visit (signed: causal offsets can be
    negative)."""
    s("i0s = I(i0)",
      "w_first = i0s + I(warp) * 16",
      "r0 = w_first + I(g)",
      "r1 = r0 + 8",
      "e0 = key_end(r0, Nk, causal, causal_offset)",
      "e1 = key_end(r1, Nk, causal, causal_offset)",
      "warp_min_end = key_end(w_first, Nk, causal, causal_offset)",
      "warp_keys = key_end(min(Nq - 1, w_first + 15), Nk, causal, causal_offset) "
      "if w_first < Nq else 0",
      "block_keys = key_end(min(Nq, i0s + %d) - 1, Nk, causal, causal_offset)" % BR)


def _emit_q_ready(s, VEC, HOLDQ, NKK, load_q):
    """Emit the wait for the staged Q tile and, when HOLDQ, its load into registers qf_{kk}_{r}
    (after which K/V may overwrite Q's shared memory)."""
    if VEC:
        s("cp_async_wait_0()")
    s("cuda.syncthreads()")
    if HOLDQ:
        for kk in range(NKK):
            load_q(kk, [f"qf_{kk}_{r}" for r in range(4)])
        s("cuda.syncthreads()  # K/V tiles reuse Q's shared memory")


def _emit_accumulators(s, NVN):
    """Emit the zeroed O fragments (NVN n8 tiles) and the running max / sum of both rows."""
    for n in range(NVN):
        s(", ".join(f"o_{n}_{r}" for r in range(4)) + " = ZERO, ZERO, ZERO, ZERO")
    s("m0 = NEG_INF", "m1 = NEG_INF", "l0 = ZERO", "l1 = ZERO")


def _emit_epilogue(s, NVN, store):
    """Emit the quad sums of l, 1 / l, the O stores (``store(n, ra, rb, half)`` writes O tile n's
    registers ra, rb of row half, in scope: ru, cbase, inv0 / inv1) and lse."""
    for half, row in ((0, "r0"), (1, "r1")):
        s(f"l{half} += cuda.shfl_xor_sync(FULL, l{half}, 1)",
          f"l{half} += cuda.shfl_xor_sync(FULL, l{half}, 2)",
          # l is 0 for a row that saw no key, NaN if an input was: NaN must reach the output
          f"inv{half} = ZERO if l{half} == ZERO else ONE / l{half}")
        s(f"if {row} < Nq:")
        with s.block():
            s(f"ru = U({row})", f"cbase = t * {U(2)}")
            ra, rb = (0, 1) if half == 0 else (2, 3)
            for n in range(NVN):
                store(n, ra, rb, half)
            s("if t == U(0):")
            with s.block():
                s(f"lse[b, h, ru] = NEG_INF if l{half} == ZERO else "
                  f"m{half} * scale + math.log(l{half})")


def _emit_mask_and_softmax(s, NN, NVN, BC, DBG, rescale_o=True):
    """Emit, for one warp's S fragments (NN n8 tiles, 4 registers each), the boundary / causal mask,
    the optional debug dump of tile 0, and the online-softmax update of m, l and (``rescale_o``)
    the NVN O tiles; otherwise alpha0 / alpha1 are left for the caller to apply.
    Shared by the f16/bf16 and one-value-per-word generators: their C fragments have one layout."""
    # ---- mask keys past Nk / above the causal diagonal (boundary tiles only)
    s(f"if j0 + {BC} > warp_min_end:")
    with s.block():
        s("cb = j0 + I(t) * 2")
        for n in range(NN):
            for r, (e, add) in enumerate((("e0", 0), ("e0", 1), ("e1", 0), ("e1", 1))):
                s(f"if cb + {n * 8 + add} >= {e}:")
                with s.block():
                    s(f"s_{n}_{r} = NEG_INF")
    if DBG:
        s("if j0 == 0:")
        with s.block():
            for n in range(NN):
                for r, (row, add) in enumerate((("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1))):
                    s(f"if {row} < Nq:")
                    with s.block():
                        s(f"dbg[b, h, U({row}), t * {U(2)} + {U(n * 8 + add)}] = s_{n}_{r}")

    # ---- online softmax on the fragments (rows r0: regs 0,1; r1: regs 2,3)
    for half, (ra, rb) in enumerate(((0, 1), (2, 3))):
        terms = [f"s_{n}_{r}" for n in range(NN) for r in (ra, rb)]
        s(f"mx = {terms[0]}")
        for term in terms[1:]:
            s(f"mx = max(mx, {term})")
        s("mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 1))",
          "mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 2))",
          f"mn = max(m{half}, mx)",
          "mu = ZERO if mn == NEG_INF else mn * scale_log2",
          # exactly 1 while the max stands: computed, m * scale_log2 - mu contracts to an fma
          # whose result is mu's rounding error, and l and O were scaled by 2**(that) every
          # tile -- lse drifted with the number of key tiles (1.2e-4 at N=131072)
          f"alpha{half} = ONE if mn == m{half} else ex2(m{half} * scale_log2 - mu)",
          f"m{half} = mn")
        for term in terms:
            s(f"{term} = ex2({term} * scale_log2 - mu)")
        s(f"l{half} = l{half} * alpha{half} + (" + " + ".join(terms) + ")")
        for n in range(NVN if rescale_o else 0):
            for r in (ra, rb):
                s(f"o_{n}_{r} *= alpha{half}")


def kernel_source(D, DV, NW, BC, HOLDQ, DT, VEC, DBG=0):
    """Python source of the kernel for one compile-time config (see module docstring)."""
    assert D % 16 == 0 and DV % 16 == 0 and BC % 16 == 0
    BR, NT = 16 * NW, 32 * NW
    QW, KW = D // 2 + 4, D // 2 + 4          # words per Q / K smem row
    if VEC:
        VW = DV // 2 + 4                      # V row-major: [BC][DV/2 + 4]
        v_words = BC * VW
    else:
        VW = BC // 2 + 4                      # Vt: [DV][BC/2 + 4]
        v_words = DV * VW
    kv_words = BC * KW + v_words
    Q_OFF = 0
    KV_OFF = 0 if HOLDQ else BR * QW       # Q is dead once it sits in registers
    NKK, NN, NVN, NPK = D // 16, BC // 8, DV // 8, BC // 16
    mma = "mma_" + DT
    pack = "pack_" + DT + "x2"

    s = _Src()
    s("def mma_attention(q, k, v, out, lse, dbg, scale_log2_in, scale_in, causal, "
      "causal_offset):")
    with s.block():
        _emit_prologue(s, BR, "float32", "uint32")

        # ---- stage Q
        if VEC:
            _emit_cp_async_rows(s, "qh", BR, "row", "i0", "Nq_u", D, "d_u", Q_OFF, QW, 8, 2, NT)
            s("cp_async_commit()")
        else:
            s(f"for idx in range(tid, {U(BR * D // 2)}, {U(NT)}):")
            with s.block():
                s(f"r = idx // {U(D // 2)}",
                  f"w = idx % {U(D // 2)}",
                  "c = w + w",
                  "row = i0 + r",
                  f"word = {U(0)}",
                  "if row < Nq_u and c < d_u:")
                with s.block():
                    s("word = U(qh[row, c])",
                      f"if c + {U(1)} < d_u:")
                    with s.block():
                        s(f"word |= U(qh[row, c + {U(1)}]) << {U(16)}")
                s(f"smem[{U(Q_OFF)} + r * {U(QW)} + w] = uint32(word)")

        # ---- per-warp / per-thread row bookkeeping (signed: causal offsets can be negative)
        _emit_row_bounds(s, BR)

        def q_frag(kk, r):
            if HOLDQ:
                return f"qf_{kk}_{r}"
            return None

        # Q fragment word offsets relative to the thread's base (16 warp + g) * QW + t
        s(f"qbase = {U(Q_OFF)} + (warp * {U(16)} + g) * {U(QW)} + t")
        if VEC:
            # ldmatrix.x4 for A: lanes 0-15 address rows 0-15 at column kk*16, lanes 16-31 the
            # same rows at column kk*16 + 8 -> registers a0..a3 in mma order
            s(f"qlm = shared_addr(smem, {U(Q_OFF)} + (warp * {U(16)} + lane % {U(16)}) * {U(QW)} "
              f"+ (lane // {U(16)}) * {U(4)})")

        def load_q(kk, names):
            if VEC:
                s(f"{', '.join(names)} = ldmatrix_x4(qlm + {U(kk * 32)})")
            else:
                offs = (kk * 8, 8 * QW + kk * 8, kk * 8 + 4, 8 * QW + kk * 8 + 4)
                for nm, off in zip(names, offs):
                    s(f"{nm} = smem[qbase + {U(off)}]")

        _emit_q_ready(s, VEC, HOLDQ, NKK, load_q)

        # ---- accumulators
        _emit_accumulators(s, NVN)

        # ---- K/V tile staging
        def stage_kv(j0u, buf):
            base = KV_OFF + buf * kv_words
            k_off, v_off = base, base + BC * KW
            if VEC:
                _emit_cp_async_rows(s, "kh", BC, "j", j0u, "Nk_u", D, "d_u", k_off, KW, 8, 2, NT)
                _emit_cp_async_rows(s, "vh", BC, "j", j0u, "Nk_u", DV, "dv_u", v_off, VW, 8, 2,
                                    NT)
                s("cp_async_commit()")
            else:
                s(f"for idx in range(tid, {U(BC * D // 2)}, {U(NT)}):")
                with s.block():
                    s(f"r = idx // {U(D // 2)}",
                      f"w = idx % {U(D // 2)}",
                      "c = w + w",
                      f"j = {j0u} + r",
                      f"word = {U(0)}",
                      "if j < Nk_u and c < d_u:")
                    with s.block():
                        s("word = U(kh[j, c])",
                          f"if c + {U(1)} < d_u:")
                        with s.block():
                            s(f"word |= U(kh[j, c + {U(1)}]) << {U(16)}")
                    s(f"smem[{U(k_off)} + r * {U(KW)} + w] = uint32(word)")
                s(f"for idx in range(tid, {U(DV * BC // 2)}, {U(NT)}):")
                with s.block():
                    s(f"jp = idx // {U(DV)}",
                      f"c = idx % {U(DV)}",
                      f"j = {j0u} + jp + jp",
                      f"word = {U(0)}",
                      "if c < dv_u:")
                    with s.block():
                        s("if j < Nk_u:")
                        with s.block():
                            s("word = U(vh[j, c])")
                        s(f"if j + {U(1)} < Nk_u:")
                        with s.block():
                            s(f"word |= U(vh[j + {U(1)}, c]) << {U(16)}")
                    s(f"smem[{U(v_off)} + c * {U(VW)} + jp] = uint32(word)")
            return k_off, v_off

        with _tile_loop(s, stage_kv, BC, kv_words, VEC, KV_OFF, KW) as (k_off, v_off, kb):
            s("if j0 < warp_keys:")
            with s.block():
                # ---- S = Q K^T
                for n in range(NN):
                    s(", ".join(f"s_{n}_{r}" for r in range(4)) + " = ZERO, ZERO, ZERO, ZERO")
                if VEC:
                    # ldmatrix.x4 for B of Q K^T (K row-major = B col-major): matrices
                    # (n-tile n, k 0-7), (n, k 8-15), (n+1, k 0-7), (n+1, k 8-15)
                    s(f"klm = shared_addr(smem, {kb}{U(k_off)} + ((lane // {U(16)}) * {U(8)} + "
                      f"lane % {U(8)}) * {U(KW)} + ((lane // {U(8)}) % {U(2)}) * {U(4)})")
                else:
                    s(f"kbase = {kb}{U(k_off)} + g * {U(KW)} + t")
                for kk in range(NKK):
                    if HOLDQ:
                        qa = [f"qf_{kk}_{r}" for r in range(4)]
                    else:
                        qa = [f"qa{r}" for r in range(4)]
                        load_q(kk, qa)
                    for n in range(NN):
                        if VEC:
                            if n % 2 == 0:
                                s(f"kb0, kb1, kb2, kb3 = ldmatrix_x4(klm + "
                                  f"{U(4 * (n * 8 * KW + kk * 8))})")
                            b0, b1 = ("kb0", "kb1") if n % 2 == 0 else ("kb2", "kb3")
                        else:
                            s(f"kb0 = smem[kbase + {U(n * 8 * KW + kk * 8)}]",
                              f"kb1 = smem[kbase + {U(n * 8 * KW + kk * 8 + 4)}]")
                            b0, b1 = "kb0", "kb1"
                        acc = ", ".join(f"s_{n}_{r}" for r in range(4))
                        s(f"{acc} = {mma}({', '.join(qa)}, {b0}, {b1}, {acc})")

                _emit_mask_and_softmax(s, NN, NVN, BC, DBG)

                # ---- O += P V, P packed from the S fragments in registers
                if VEC:
                    # ldmatrix.x4.trans for B of P V from row-major V: matrices
                    # (keys 0-7, n-tile n), (keys 8-15, n), (keys 0-7, n+1), (keys 8-15, n+1)
                    s(f"vlm = shared_addr(smem, {kb}{U(v_off)} + (((lane // {U(8)}) % {U(2)}) * "
                      f"{U(8)} + lane % {U(8)}) * {U(VW)} + (lane // {U(16)}) * {U(4)})")
                else:
                    s(f"vbase = {kb}{U(v_off)} + g * {U(VW)} + t")
                for kk in range(NPK):
                    n0, n1 = 2 * kk, 2 * kk + 1
                    s(f"pa0 = {pack}(s_{n0}_0, s_{n0}_1)",
                      f"pa1 = {pack}(s_{n0}_2, s_{n0}_3)",
                      f"pa2 = {pack}(s_{n1}_0, s_{n1}_1)",
                      f"pa3 = {pack}(s_{n1}_2, s_{n1}_3)")
                    for n in range(NVN):
                        if VEC:
                            if n % 2 == 0:
                                s(f"vb0, vb1, vb2, vb3 = ldmatrix_x4_trans(vlm + "
                                  f"{U(4 * (kk * 16 * VW + n * 4))})")
                            b0, b1 = ("vb0", "vb1") if n % 2 == 0 else ("vb2", "vb3")
                        else:
                            s(f"vb0 = smem[vbase + {U(n * 8 * VW + kk * 8)}]",
                              f"vb1 = smem[vbase + {U(n * 8 * VW + kk * 8 + 4)}]")
                            b0, b1 = "vb0", "vb1"
                        acc = ", ".join(f"o_{n}_{r}" for r in range(4))
                        s(f"{acc} = {mma}(pa0, pa1, pa2, pa3, {b0}, {b1}, {acc})")

        # ---- epilogue: row sums over the quad, normalize, write O (16-bit bits) and lse
        def store(n, ra, rb, half):
            s(f"word = U({pack}(o_{n}_{ra} * inv{half}, o_{n}_{rb} * inv{half}))",
              f"col = cbase + {U(n * 8)}",
              "if col < dv_u:")
            with s.block():
                s(f"oh[ru, col] = uint16(word & {U(0xFFFF)})")
            s(f"if col + {U(1)} < dv_u:")
            with s.block():
                s(f"oh[ru, col + {U(1)}] = uint16(word >> {U(16)})")
        _emit_epilogue(s, NVN, store)
    return s.text()


# ------------------------------------------------------------------------ tf32 and float64

#: How the one-element-per-word kernels differ: the shared-memory word type, how an input element
#: becomes a word (and the zero word), how a probability becomes an A operand, the V row pad
#: (in words; both make the P V B-fragment loads conflict-free), and the mma.
WORD_KINDS = {
    "tf32": {"word": "uint32", "load": "U(to_tf32({}))", "zero": "U(0)", "store": "uint32(word)",
             "p": "to_tf32({})", "v_pad": 4, "float": "float32", "mma": "mma_tf32"},
    "f64": {"word": "float64", "load": "{}", "zero": "ZERO", "store": "word",
            "p": "{}", "v_pad": 2, "float": "float64", "mma": "mma_f64"},
    # float32 kept whole in shared memory; every operand is split into tf32 (hi, lo) as it is
    # read (split_tf32) and each product is three tf32 mma: 3xTF32, float32-level accuracy
    "3xtf32": {"word": "float32", "load": "{}", "zero": "ZERO", "store": "word",
               "p": None, "v_pad": 4, "float": "float32", "mma": "mma_tf32"},
}


def word_pads(DT):
    """(Q/K pad, V pad) in words per shared row for a one-element-per-word kernel."""
    return 4, WORD_KINDS[DT]["v_pad"]


def word_layout(D, DV, NW, BC, HOLDQ, DT, VEC):
    """Shared-memory layout of a one-element-per-word kernel, in words: (QW, KW, VW) row pitches,
    the Q tile's words, one K/V buffer's words, where K/V start, and the total words."""
    qk_pad, v_pad = word_pads(DT)
    QW, KW, VW = D + qk_pad, D + qk_pad, DV + v_pad
    q_words, kv_words = 16 * NW * QW, BC * KW + BC * VW
    kv_off = 0 if HOLDQ else q_words      # Q is dead once it sits in registers
    kv_total = kv_words * (2 if VEC else 1)
    total = max(q_words, kv_total) if HOLDQ else q_words + kv_total
    return (QW, KW, VW), q_words, kv_words, kv_off, total


def kernel_source_word(D, DV, NW, BC, HOLDQ, DT, DBG=0, VEC=0):
    """Source of the kernels that keep one element per shared-memory word: float32 inputs on tf32
    tensor cores, as 3xTF32 (DT="3xtf32") or with one tf32 mma per product (DT="tf32",
    precision="tf32"), and float64 on float64 tensor cores (DT="f64").

    Same structure as the 16-bit kernel (one warp per 16 query rows, S and O in registers, online
    softmax on the fragments) with a 16x8x8 mma: ``mma.sync.m16n8k8.f32.tf32.tf32.f32``, or for
    float64 ``mma.sync.m16n8k8.f64`` (sm_90) / four ``m8n8k4.f64`` (sm_80) with the same fragment
    layout (ptx.mma_f64_*). Q/K/V are staged with scalar loads (tf32: rounded once by
    ``cvt.rna.tf32.f32`` on the way into shared memory), one value per 32- or 64-bit word:
    Q [BR][D + 4], K [BC][D + 4], V [BC][DV + pad] (row-major; the pads make every fragment load
    bank-conflict free: for 64-bit words a half-warp's g = 0..3, t = 0..3 must hit 16 distinct
    word slots mod 16, which D + 4 gives for Q/K rows g and DV + 2 for V rows 2t).

    P goes back into P V without data movement: the contraction index of an m16n8k8 may be
    permuted as long as A's columns and B's rows are permuted alike. The S accumulator of key
    tile n gives thread (g, t) keys 2t, 2t+1 of rows g, g+8; the A fragment wants k = t, t+4.
    Mapping k = t -> key 2t and k = t + 4 -> key 2t+1 makes the A fragment (s0, s2, s1, s3)
    and the B fragment (V[2t, g], V[2t+1, g]).

    3xTF32 keeps float32 whole in shared memory and splits every operand as it is read into
    registers (ptx.split_tf32: x = hi + lo, both tf32) and each product into three mma,
    A_h B_h + A_h B_l + A_l B_h (the dropped A_l B_l is at most 2**-20 of A B, about 2**-22 on
    average: a few float32 roundings). Tensor cores do not round
    their float32 accumulation to nearest, so sums that grow over many mma drift (measured
    2.9e-5 relative at N=4096 when O went through every mma of the row): the small terms get
    their own accumulator, and each key tile's P V is accumulated from zero per n8 tile, then
    added to the rescaled O in float32 (``o = o * alpha + (big + small)``); O never passes
    through a tensor core.

    VEC=1 (float64, 3xTF32; tf32 rounds on the way in) copies rows with 16-byte cp.async and
    double-buffers K/V like the 16-bit kernel; it needs what ``vector_ok`` checks.
    """
    assert D % 8 == 0 and DV % 8 == 0 and BC % 8 == 0
    assert not (VEC and DT == "tf32"), "tf32 operands are rounded as they are staged (VEC=0)"
    kind = WORD_KINDS[DT]
    flt, mma, pconv = kind["float"], kind["mma"], kind["p"]
    split = DT == "3xtf32"
    BR, NT = 16 * NW, 32 * NW
    (QW, KW, VW), _, kv_words, KV_OFF, _ = word_layout(D, DV, NW, BC, HOLDQ, DT, VEC)
    Q_OFF = 0
    NKK, NN, NVN, NPK = D // 8, BC // 8, DV // 8, BC // 8
    chunk = 2 if DT == "f64" else 4    # elements per 16-byte cp.async

    def operand(name, expr):
        """Read one A/B operand register; 3xTF32 splits it into name_h, name_l."""
        s(f"{name}_h, {name}_l = split_tf32({expr})" if split else f"{name} = {expr}")

    def product(acc, a, b, small=None):
        """Emit acc += A B. 3xTF32: the two small terms A_l B_h + A_h B_l go to ``small`` (kept
        apart from acc, so their 2**-11-sized sums are not truncated against acc's magnitude:
        tensor cores do not round their float32 accumulation to nearest) and A_h B_h to acc."""
        if not split:
            s(f"{', '.join(acc)} = {mma}({', '.join(a + b)}, {', '.join(acc)})")
            return
        for sa, sb, into in (("_l", "_h", small), ("_h", "_l", small), ("_h", "_h", acc)):
            ops = ", ".join([x + sa for x in a] + [x + sb for x in b])
            s(f"{', '.join(into)} = {mma}({ops}, {', '.join(into)})")

    def stage_kv(j0u, buf):
        """Emit the copy of K/V tile rows j0u.. into buffer buf; returns the word offsets."""
        k_off = KV_OFF + buf * kv_words
        v_off = k_off + BC * KW
        if VEC:
            _emit_cp_async_rows(s, "kh", BC, "j", j0u, "Nk_u", D, "d_u", k_off, KW, chunk, 1, NT)
            _emit_cp_async_rows(s, "vh", BC, "j", j0u, "Nk_u", DV, "dv_u", v_off, VW, chunk, 1,
                                NT)
            s("cp_async_commit()")
            return k_off, v_off
        for name, off, W, width, dim in (("kh", k_off, KW, D, "d_u"),
                                         ("vh", v_off, VW, DV, "dv_u")):
            s(f"for idx in range(tid, {U(BC * width)}, {U(NT)}):")
            with s.block():
                s(f"r = idx // {U(width)}",
                  f"c = idx % {U(width)}",
                  f"j = {j0u} + r",
                  f"word = {kind['zero']}",
                  f"if j < Nk_u and c < {dim}:")
                with s.block():
                    s("word = " + kind["load"].format(f"{name}[j, c]"))
                s(f"smem[{U(off)} + r * {U(W)} + c] = {kind['store']}")
        return k_off, v_off

    s = _Src()
    s("def mma_attention(q, k, v, out, lse, dbg, scale_log2_in, scale_in, causal, "
      "causal_offset):")
    with s.block():
        _emit_prologue(s, BR, flt, kind["word"])

        # ---- stage Q (one element per word)
        if VEC:
            _emit_cp_async_rows(s, "qh", BR, "row", "i0", "Nq_u", D, "d_u", Q_OFF, QW, chunk, 1,
                                NT)
            s("cp_async_commit()")
        else:
            s(f"for idx in range(tid, {U(BR * D)}, {U(NT)}):")
            with s.block():
                s(f"r = idx // {U(D)}",
                  f"c = idx % {U(D)}",
                  "row = i0 + r",
                  f"word = {kind['zero']}",
                  "if row < Nq_u and c < d_u:")
                with s.block():
                    s("word = " + kind["load"].format("qh[row, c]"))
                s(f"smem[{U(Q_OFF)} + r * {U(QW)} + c] = {kind['store']}")

        _emit_row_bounds(s, BR)

        # A fragment of k-step kk: a0 = Q[g, 8kk+t], a1 = Q[g+8, 8kk+t], a2/a3 at column +4
        s(f"qbase = {U(Q_OFF)} + (warp * {U(16)} + g) * {U(QW)} + t")

        def load_q(kk, names):
            offs = (kk * 8, 8 * QW + kk * 8, kk * 8 + 4, 8 * QW + kk * 8 + 4)
            for nm, off in zip(names, offs):
                operand(nm, f"smem[qbase + {U(off)}]")

        _emit_q_ready(s, VEC, HOLDQ, NKK, load_q)

        _emit_accumulators(s, NVN)

        with _tile_loop(s, stage_kv, BC, kv_words, VEC, KV_OFF, KW) as (k_off, v_off, kb):
            s("if j0 < warp_keys:")
            with s.block():
                # ---- S = Q K^T: B fragment b0 = K[n8 + g, 8kk + t], b1 at column + 4
                for n in range(NN):
                    for acc in ("s", "c") if split else ("s",):
                        s(", ".join(f"{acc}_{n}_{r}" for r in range(4)) +
                          " = ZERO, ZERO, ZERO, ZERO")
                s(f"kbase = {kb}{U(k_off)} + g * {U(KW)} + t")
                for kk in range(NKK):
                    if HOLDQ:
                        qa = [f"qf_{kk}_{r}" for r in range(4)]
                    else:
                        qa = [f"qa{r}" for r in range(4)]
                        load_q(kk, qa)
                    for n in range(NN):
                        operand("kb0", f"smem[kbase + {U(n * 8 * KW + kk * 8)}]")
                        operand("kb1", f"smem[kbase + {U(n * 8 * KW + kk * 8 + 4)}]")
                        product([f"s_{n}_{r}" for r in range(4)], qa, ["kb0", "kb1"],
                                [f"c_{n}_{r}" for r in range(4)])
                for n in range(NN if split else 0):
                    s(*(f"s_{n}_{r} += c_{n}_{r}" for r in range(4)))

                # 3xTF32 rescales O where each tile's P V is added (below)
                _emit_mask_and_softmax(s, NN, NVN, BC, DBG, rescale_o=not split)

                # ---- O += P V with the permuted contraction index (see docstring):
                # A = (P[g, 2t], P[g+8, 2t], P[g, 2t+1], P[g+8, 2t+1]) of key tile kk,
                # B = (V[8kk + 2t, n8 + g], V[8kk + 2t + 1, n8 + g])
                s(f"vbase = {kb}{U(v_off)} + t * {U(2 * VW)} + g")

                def load_v(kk, n):
                    operand("vb0", f"smem[vbase + {U(kk * 8 * VW + n * 8)}]")
                    operand("vb1", f"smem[vbase + {U(kk * 8 * VW + VW + n * 8)}]")

                if not split:
                    for kk in range(NPK):
                        pa = [pconv.format(f"s_{kk}_{r}") for r in (0, 2, 1, 3)]
                        s(*(f"pa{i} = {x}" for i, x in enumerate(pa)))
                        for n in range(NVN):
                            load_v(kk, n)
                            product([f"o_{n}_{r}" for r in range(4)],
                                    [f"pa{i}" for i in range(4)], ["vb0", "vb1"])
                else:
                    # each n8 tile of this key tile's P V into fresh accumulators, added to the
                    # rescaled O in float32: O never goes through the tensor cores' truncating
                    # accumulation, so its error does not grow with the number of keys
                    for kk in range(NPK):
                        for i, r in enumerate((0, 2, 1, 3)):
                            operand(f"pa_{kk}_{i}", f"s_{kk}_{r}")
                    for n in range(NVN):
                        s("pv0, pv1, pv2, pv3 = ZERO, ZERO, ZERO, ZERO",
                          "pc0, pc1, pc2, pc3 = ZERO, ZERO, ZERO, ZERO")
                        for kk in range(NPK):
                            load_v(kk, n)
                            product([f"pv{r}" for r in range(4)],
                                    [f"pa_{kk}_{i}" for i in range(4)], ["vb0", "vb1"],
                                    [f"pc{r}" for r in range(4)])
                        for r in range(4):
                            s(f"o_{n}_{r} = o_{n}_{r} * alpha{r // 2} + (pv{r} + pc{r})")

        # ---- epilogue: row sums over the quad, normalize, write O and lse
        def store(n, ra, rb, half):
            s(f"col = cbase + {U(n * 8)}",
              "if col < dv_u:")
            with s.block():
                s(f"oh[ru, col] = o_{n}_{ra} * inv{half}")
            s(f"if col + {U(1)} < dv_u:")
            with s.block():
                s(f"oh[ru, col + {U(1)}] = o_{n}_{rb} * inv{half}")
        _emit_epilogue(s, NVN, store)
    return s.text()


def smem_bytes(cfg):
    D, DV, NW, BC, HOLDQ, VEC = (cfg[x] for x in ("D", "DV", "NW", "BC", "HOLDQ", "VEC"))
    BR = 16 * NW
    if cfg.get("DT") in WORD_KINDS:  # one value per 4- or 8-byte word
        total = word_layout(D, DV, NW, BC, HOLDQ, cfg["DT"], VEC)[-1]
        return (8 if cfg["DT"] == "f64" else 4) * total
    q_words = BR * (D // 2 + 4)
    v_words = BC * (DV // 2 + 4) if VEC else DV * (BC // 2 + 4)
    kv_words = (BC * (D // 2 + 4) + v_words) * (2 if VEC else 1)
    return 4 * (max(q_words, kv_words) if HOLDQ else q_words + kv_words)


_counter = [0]


def make_kernel(D, DV, NW, BC, HOLDQ, DT, VEC, DBG=0, MMA=None):
    """The kernel function for one compile-time config (numba compiles it; see launch.py).
    MMA (float64 only): "m16n8k8" (sm_90) or "m8n8k4" (sm_80), the instruction behind mma_f64."""
    from numba import cuda, float32, float64, int64, uint16, uint32, uint64
    from . import ptx

    if DT in WORD_KINDS:
        assert (MMA is not None) == (DT == "f64"), "MMA names the float64 instruction only"
        src = kernel_source_word(D, DV, NW, BC, HOLDQ, DT, DBG, VEC)
    else:
        src = kernel_source(D, DV, NW, BC, HOLDQ, DT, VEC, DBG)
    _counter[0] += 1
    filename = f"<numflash.cuda.mma D{D} DV{DV} NW{NW} BC{BC} HOLDQ{HOLDQ} {DT} VEC{VEC} " \
               f"DBG{DBG} MMA{MMA} #{_counter[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    real = np.float64 if DT == "f64" else np.float32
    ns = {
        "cuda": cuda, "math": math, "U": uint64, "I": int64, "uint32": uint32, "uint16": uint16,
        "float32": float32, "float64": float64,
        "ZERO": real(0), "ONE": real(1), "NEG_INF": real(-np.inf),
        "FULL": 0xFFFFFFFF, "key_end": key_end, "kv_head": kv_head,
        "mma_f16": ptx.mma_f16, "mma_bf16": ptx.mma_bf16, "mma_tf32": ptx.mma_tf32,
        "to_tf32": ptx.to_tf32, "split_tf32": ptx.split_tf32,
        "mma_f64": ptx.mma_f64_m16n8k8 if MMA == "m16n8k8" else ptx.mma_f64_m8n8k4x4,
        "pack_f16x2": ptx.pack_f16x2, "pack_bf16x2": ptx.pack_bf16x2,
        # float64 needs the exact exp2 (libdevice), not ex2.approx.f32
        "ex2": math.exp2 if DT == "f64" else ptx.ex2,
        "ldmatrix_x4": ptx.ldmatrix_x4, "ldmatrix_x4_trans": ptx.ldmatrix_x4_trans,
        "shared_addr": ptx.shared_addr, "global_addr2": ptx.global_addr2,
        "cp_async_16": ptx.cp_async_16, "cp_async_commit": ptx.cp_async_commit,
        "cp_async_wait_0": ptx.cp_async_wait_0, "cp_async_wait_1": ptx.cp_async_wait_1,
    }
    exec(compile(src, filename, "exec"), ns)
    return ns["mma_attention"]


def _kv_head_py(h, H, Hkv):
    return h // (H // Hkv)


def _make_kv_head():
    from numba import cuda
    return cuda.jit(device=True)(_kv_head_py)


kv_head = _make_kv_head()
kv_head.__doc__ = """The K/V head serving query head h (GQA: H / Hkv query heads share one)."""


# ------------------------------------------------------------------------------ plan interface

#: float64 tiles (NW, BC, HOLDQ) by largest head dim, fastest first, from the f64 section of
#: bench/mma_probe.py on an H200 (B4 H16 N4096: d=64 9.8 / 10.5 ms, d=128 18.3 / 29.2 ms;
#: bench/NOTES.md); the second is for less shared memory (d=64: the 99 KB a block gets on
#: sm_86/89). A float64 fragment takes two registers per value, so ~250 registers a thread allow
#: one 8-warp block per SM: 8 warps share each K/V tile.
F64_TILES = {64: ((8, 64, 0), (8, 32, 1)), 128: ((8, 16, 0), (4, 16, 0))}
#: Where 3xTF32 can beat the FMA units: tf32 mma.sync at >= 8x the fp32 FMA rate on the A100 /
#: H100 class (timed on the H100 only); on sm_86 / 89 / 12x tf32 tensor cores run at about the
#: FMA rate, so three mma per product lose.
X3_CCS = ((8, 0), (9, 0))


def _x3_tile(D, DV, smem_limit, cc):
    """(NW, BC, HOLDQ) of a 3xTF32 kernel. Timed on the H100 (x3 section of bench/mma_probe.py,
    B4 H16 N4096): d=64 (8, 64, 0) 6.05 ms, d=128 (8, 64, 0) 11.86 ms, (8, 32, 0) 13.42 ms. 8 warps
    share each K/V tile; Q is re-read from shared memory (held, its hi / lo halves would take D/2
    more registers). Each thread holds O (DV/2), S (2 x BC/2) and the split P (BC) in registers,
    so the wide tile is kept to head dims where ptxas fits it in 255 with no spill (checked by
    tests/test_cuda_3xtf32.py): BC=64 spills 12-24 bytes at d=96 or DV > D on sm_90, BC=32 at
    d=96 / dv=128 on sm_90, and on sm_80 ptxas needs more registers than on sm_90 for the same
    source (BC=32 spills at dv=128 there; BC=16 does not). d=128 (8, 64, 0) also needs the
    202 KB of sm_90."""
    tiles = []
    if max(D, DV) <= 64 or D == DV == 128:
        tiles.append((8, 64, 0))
    wide_v = DV == 128 and (D != DV or (cc is not None and cc < (9, 0)))
    tiles.append((8, 16, 0) if wide_v else (8, 32, 0))
    for NW, BC, HOLDQ in tiles:
        cfg = {"D": D, "DV": DV, "NW": NW, "BC": BC, "HOLDQ": HOLDQ, "DT": "3xtf32", "VEC": 1}
        if smem_limit is None or smem_bytes(cfg) <= smem_limit:
            return NW, BC, HOLDQ
    return tiles[-1]  # config() refuses it, naming the shared memory it needs


def _tile(D, DV, DT=None, smem_limit=None, VEC=0, cc=None):
    """(NW, BC, HOLDQ) for padded head dims, chosen for registers: O (DV/2 floats), S (BC/2) and,
    when HOLDQ, Q (D/4 words; tf32: D/2) per thread. float64 takes the first of F64_TILES whose
    shared memory fits smem_limit (sm_80 allows 163 KB a block, sm_86/89 99 KB); 3xTF32 is
    chosen by ``_x3_tile``, which also depends on the compute capability ``cc``."""
    if DT == "tf32":
        return (4, 64, 1) if max(D, DV) <= 64 else (4, 64, 0)
    if DT == "3xtf32":
        return _x3_tile(D, DV, smem_limit, cc)
    if DT == "f64":
        tiles = F64_TILES[64 if max(D, DV) <= 64 else 128]
        for NW, BC, HOLDQ in tiles:
            cfg = {"D": D, "DV": DV, "NW": NW, "BC": BC, "HOLDQ": HOLDQ, "DT": DT, "VEC": VEC}
            if smem_limit is None or smem_bytes(cfg) <= smem_limit:
                return NW, BC, HOLDQ
        return tiles[-1]  # config() refuses it, naming the shared memory it needs
    if max(D, DV) <= 128:
        return 4, 64, 1
    return 4, 32, 0


def vector_ok(problem):
    """None if 16-byte cp.async can read every row of q, k, v, else why not (then VEC=0)."""
    for name in ("q", "k", "v"):
        a = getattr(problem, name)
        item = a.itemsize
        if a.strides[-1] != item and a.shape[-1] > 1:
            return f"{name}'s last axis is strided"
        if a.shape[-1] % (16 // item):  # a 16-byte chunk never straddles the row's end
            return f"{name}'s head dim {a.shape[-1]} is not a multiple of {16 // item}"
        if a.data.ptr % 16:
            return f"{name} is not 16-byte aligned"
        for n, st in zip(a.shape[:-1], a.strides[:-1]):
            if n > 1 and st % 16:
                return f"{name} has a row stride of {st} bytes, not a multiple of 16"
    return None


#: float32 (3xTF32, or tf32 with precision="tf32") takes head dims up to this (d=256 would keep
#: 128 O accumulators per thread and spill).
TF32_MAX_HEAD_DIM = 128
#: float64 takes head dims up to these, by mma form: its fragments take two registers per value,
#: so d=256 would keep 256 registers of O per thread; on sm_80 (four m8n8k4 per product) ptxas
#: spills already at dv=128.
F64_MAX_HEAD_DIM = {"m16n8k8": 128, "m8n8k4": 64}


def config(problem, device):
    dt = problem.dtype.name
    precision = getattr(problem, "precision", "auto")
    if dt not in ("float16", "bfloat16", "float32", "float64"):
        raise Unsupported(f"{NAME} takes float16, bfloat16, float32 and float64; not {dt}")
    if dt == "float32" and precision == "ieee":
        raise Unsupported(IEEE_REASON)
    if device.simulator:
        raise Unsupported(f"{NAME} uses inline PTX, which numba's CUDA simulator cannot run")
    if device.cc is not None and device.cc < (8, 0):
        raise Unsupported(f"{NAME} needs compute capability >= 8.0 (mma.sync bf16 / f64, "
                          "cp.async)")
    B, H, Nq, Nk, d, dv = problem.shape
    if problem.k.shape[1] == 0 or H % problem.k.shape[1]:
        raise Unsupported(f"{NAME}: {H} query heads do not divide into {problem.k.shape[1]} "
                          "K/V heads")
    D, DV = head_dim_pad(d), head_dim_pad(dv)
    vector = problem.on_device and vector_ok(problem) is None
    form = None
    if dt == "float32":
        DT = "tf32" if precision == "tf32" else "3xtf32"
        if max(D, DV) > TF32_MAX_HEAD_DIM:
            raise Unsupported(f"{NAME} takes float32 head dims up to {TF32_MAX_HEAD_DIM}; got "
                              f"d={d}, dv={dv} (with precision='auto' cuda.block takes float32 "
                              "up to d=256)")
        if DT == "3xtf32" and device.cc is not None and device.cc not in X3_CCS:
            raise Unsupported(
                f"{NAME} runs float32 as 3xTF32 (three tf32 mma per product) only on compute "
                f"capability 8.0 / 9.0, where tf32 tensor cores outrun the FMA units ~8x; on "
                f"{device.name} cuda.block is faster (precision='tf32' takes the tensor cores "
                "with one tf32 mma per product)")
        if DT == "3xtf32" and not vector:
            raise Unsupported(
                f"{NAME} runs float32 (3xTF32) only with 16-byte cp.async staging, and "
                f"{vector_ok(problem) or 'these are not device arrays'}: staged with scalar "
                "loads it is slower than cuda.block (a contiguous last axis, d and dv multiples "
                "of 4 and 16-byte aligned rows take the tensor cores)")
        VEC = int(DT == "3xtf32")  # tf32 rounds its operands on the way into shared memory
    elif dt == "float64":
        form = "m16n8k8" if device.cc is not None and device.cc >= (9, 0) else "m8n8k4"
        limit = F64_MAX_HEAD_DIM[form]
        if max(D, DV) > limit:
            raise Unsupported(f"{NAME} takes float64 head dims up to {limit} on {device.name} "
                              f"(mma {form}); got d={d}, dv={dv} (cuda.block takes float64 up to "
                              "d=256)")
        DT, VEC = "f64", int(vector)
        tile = _tile(D, DV, DT, device.smem_per_block_optin, VEC)
        if VEC and smem_bytes({"D": D, "DV": DV, "NW": tile[0], "BC": tile[1],
                               "HOLDQ": tile[2], "DT": DT, "VEC": 1}) > device.smem_per_block_optin:
            VEC = 0  # double-buffered cp.async does not fit: stage with scalar loads instead
    else:
        DT = "bf16" if dt == "bfloat16" else "f16"
        VEC = int(vector)
    NW, BC, HOLDQ = _tile(D, DV, DT, device.smem_per_block_optin, VEC, device.cc)
    cfg = {"D": D, "DV": DV, "NW": NW, "BC": BC, "HOLDQ": HOLDQ, "DT": DT, "VEC": VEC}
    if form is not None:
        cfg["MMA"] = form
    need = smem_bytes(cfg)
    if need > device.smem_per_block_optin:
        raise Unsupported(f"{NAME}: needs {need} bytes of shared memory for d={d}, dv={dv}, more "
                          f"than the {device.smem_per_block_optin} a block may use on "
                          f"{device.name}")
    return cfg


_dummy = {}


def _as_bits(a):
    import cupy
    return a.view(cupy.uint16)


def signature(dtype):
    """The kernel's argument types: q, k, v, out (16-bit inputs as their bits), lse, a float32
    debug array, the exp2 and natural scales, causal, causal_offset."""
    from numba import types
    from ..inputs import lse_dtype
    from .launch import array_type
    arr = array_type("uint16" if np.dtype(dtype).itemsize == 2 else dtype)
    return (arr, arr, arr, arr, array_type(lse_dtype(dtype), 3), array_type("float32"),
            types.float64, types.float64, types.int64, types.int64)


def compiled_kernels(cfg, dtype):
    """What run() launches for this config and input dtype: [(Kernel, numba argument types)],
    for `numflash.precompile` and `explain`'s cache status."""
    from . import launch
    return [(launch.get_kernel(NAME, make_kernel, cfg), signature(dtype))]


def run(problem, cfg, device, debug=None):
    """Launch; returns lse. ``debug``: a float32 (B, H, Nq, BC) CuPy array to receive the masked
    raw scores of key tile 0 (only with cfg["DBG"] = 1)."""
    import cupy
    from . import fastpath
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    (kernel, _), = compiled_kernels(cfg, p.dtype_name)
    lse = p.empty_lse()
    if debug is None:
        key = p.q.device.id
        if key not in _dummy:
            _dummy[key] = fastpath.keep(cupy.zeros((1, 1, 1, 1), dtype=cupy.float32))
        debug = _dummy[key]
    BR = 16 * cfg["NW"]
    grid = (-(-Nq // BR), B * H)
    # tf32 and float64 read their inputs as they are; 16-bit kernels take the bits
    bits = (lambda a: a) if cfg["DT"] in WORD_KINDS else _as_bits
    kernel(grid, (32 * cfg["NW"],), smem_bytes(cfg),
           (bits(p.q), bits(p.k), bits(p.v), bits(p.out), lse, debug,
            float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
            int(p.causal_offset)), device)
    return lse
