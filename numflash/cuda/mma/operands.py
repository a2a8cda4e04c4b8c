"""Operand kinds: how input elements become shared-memory words and mma operands, and how each
product is issued. The forward composition (forward.py) is written once over these.

- ``Packed16`` (DT "f16", "bf16"): two 16-bit elements per 32-bit word (low half = lower index),
  ``mma.sync.m16n8k16`` with float32 accumulators; fragments read with ``ldmatrix`` when staged by
  cp.async (VEC), V then row-major and read by ``ldmatrix.trans``; with scalar staging V is
  stored transposed (Vt[DV][BC/2 + 4]) so a B fragment of P V is one word per register. P goes
  back into P V from registers: the C layout of two adjacent n8 tiles is the A layout of one k16
  tile, packed to f16x2 / bf16x2.
- ``Words`` (DT "tf32", "f64"): one element per 32- or 64-bit word and a 16x8x8 mma
  (``m16n8k8.tf32``, or float64's ``m16n8k8`` on sm_90 / four ``m8n8k4`` on sm_80, one fragment
  layout: ptx.mma_f64_*). tf32 rounds its operands once (``cvt.rna.tf32.f32``) as they are
  staged. P goes back into P V without data movement: the contraction index of an m16n8k8 may be
  permuted as long as A's columns and B's rows are permuted alike. The S accumulator of key tile n
  gives thread (g, t) keys 2t, 2t+1 of rows g, g+8; the A fragment wants k = t, t+4. Mapping
  k = t -> key 2t and k = t + 4 -> key 2t+1 makes the A fragment (s0, s2, s1, s3) and the B
  fragment (V[2t, g], V[2t+1, g]).
- ``Split3xTF32`` (DT "3xtf32"): float32 kept whole in shared memory; every operand is split as
  it is read into registers (ptx.split_tf32: x = hi + lo, both tf32) and each product is three
  tf32 mma, A_h B_h + A_h B_l + A_l B_h (the dropped A_l B_l is at most 2**-20 of A B, about
  2**-22 on average: a few float32 roundings). Tensor cores do not round their float32
  accumulation to nearest, so sums that grow over many mma drift (measured 2.9e-5 relative at
  N=4096 when O went through every mma of the row): the small terms get their own accumulator,
  and each key tile's P V is accumulated from zero per n8 tile, then added to the rescaled O in
  float32 (``o = o * alpha + (big + small)``); O never passes through a tensor core.

Shared memory rows are padded so every fragment load is bank-conflict free and 16-byte aligned:
by 4 words for Q and K rows; for V by 4 words (32-bit words) or 2 (64-bit words: a half-warp's
g = 0..3, t = 0..3 must hit 16 distinct word slots mod 16, which DV + 2 gives for V rows 2t).
"""
from collections import namedtuple

from .emit import U
from .staging import emit_cp_async_rows, paged_row

#: Shared-memory layout in words: row pitches of Q, K, V; the Q tile's words; one K/V buffer's
#: words; where K/V start (over Q's space once Q is held in registers); the whole block's words.
SharedLayout = namedtuple("SharedLayout", "QW KW VW q_words kv_words kv_off total")


def _layout(cfg, QW, KW, VW, v_words):
    q_words, kv_words = cfg.BR * QW, cfg.BC * KW + v_words
    kv_off = 0 if cfg.HOLDQ else q_words      # Q is dead once it sits in registers
    kv_total = kv_words * (2 if cfg.VEC else 1)
    total = max(q_words, kv_total) if cfg.HOLDQ else q_words + kv_total
    return SharedLayout(QW, KW, VW, q_words, kv_words, kv_off, total)


def packed_a_step(pack, src, kk, names):
    """Source lines that pack k-step kk's A operand (16-bit pairs, by function ``pack``) into
    the four registers ``names`` from C fragments ``src``: the accumulator layout of two
    adjacent n8 tiles is the A layout of one k16 step (module docstring)."""
    n0, n1 = 2 * kk, 2 * kk + 1
    return (f"{names[0]} = {pack}({src}_{n0}_0, {src}_{n0}_1)",
            f"{names[1]} = {pack}({src}_{n0}_2, {src}_{n0}_3)",
            f"{names[2]} = {pack}({src}_{n1}_0, {src}_{n1}_1)",
            f"{names[3]} = {pack}({src}_{n1}_2, {src}_{n1}_3)")


class _OperandKind:
    """What every kind shares: S accumulators zeroed, one mma per product, O rescaled in the
    softmax; subclasses say how elements become words and fragments."""
    rescales_o_in_softmax = True  # O is rescaled with the running max, then P V added through it

    def zero_scores(self, s, NN, acc="s", small="c"):
        """Emit NN zeroed n8 accumulator tiles ``acc`` (and, where the kind keeps one, ``small``
        for its small terms)."""
        for n in range(NN):
            s(", ".join(f"{acc}_{n}_{r}" for r in range(4)) + " = ZERO, ZERO, ZERO, ZERO")

    def product(self, s, acc, a, b, small=None):
        """Emit acc += A B."""
        s(f"{', '.join(acc)} = {self.mma}({', '.join(a + b)}, {', '.join(acc)})")

    def finish_scores(self, s, NN, acc="s", small="c"):
        """Anything left to do to the accumulators after the last k-step."""

    # ---- staging: 16-byte cp.async rows for every kind (``chunk`` elements per 16 bytes,
    # ``per_word`` per shared word); scalar staging is each kind's own
    def stage_q(self, s):
        c, L = self.cfg, self.lay
        if c.VEC:
            emit_cp_async_rows(s, "qh", c.BR, "row", "i0", "Nq_u", c.D, "d_u", 0, L.QW,
                               self.chunk, self.per_word, c.NT)
            s("cp_async_commit()")
            return
        self._stage_q_scalar(s)

    def stage_kv(self, s, j0u, buf):
        """Emit the copy of K/V tile rows j0u.. into buffer buf; returns the word offsets."""
        c, L = self.cfg, self.lay
        k_off = L.kv_off + buf * L.kv_words
        v_off = k_off + c.BC * L.KW
        if c.VEC:
            rows = paged_row(c.PAGE) if c.PAGE else None
            emit_cp_async_rows(s, "kh", c.BC, "j", j0u, "Nk_u", c.D, "d_u", k_off, L.KW,
                               self.chunk, self.per_word, c.NT, rows)
            emit_cp_async_rows(s, "vh", c.BC, "j", j0u, "Nk_u", c.DV, "dv_u", v_off, L.VW,
                               self.chunk, self.per_word, c.NT, rows)
            s("cp_async_commit()")
        else:
            assert not c.PAGE, "a paged cache is read with cp.async"
            self._stage_kv_scalar(s, j0u, k_off, v_off)
        return k_off, v_off

    def store_partial(self, s, n, ra, rb, half):
        """Emit the store of O tile n's registers ra, rb (row half), normalized, as floats: a
        split-KV share's partial O (in the accumulators' precision, for cuda.merge)."""
        self.store_floats(s, n, ra, rb, half)

    def store_floats(self, s, n, ra, rb, half, acc="o", factor=None, out="oh", dim="dv_u"):
        """store_o's values as the accumulators hold them, unrounded (the array is of the
        accumulators' float type): split-KV partials, the backward's GRAD32 gradients."""
        f = factor or f"inv{half}"
        self._store_pair(s, n, f"{acc}_{n}_{ra} * {f}", f"{acc}_{n}_{rb} * {f}", (), out, dim)

    @staticmethod
    def _store_pair(s, n, first, second, before=(), out="oh", dim="dv_u"):
        """Emit the stores of O tile n's two columns of this thread's row (values ``first`` and
        ``second``), each guarded by dv; ``before``: lines that compute them."""
        s(*before, f"col = cbase + {U(n * 8)}", f"if col < {dim}:")
        with s.block():
            s(f"{out}[ru, col] = {first}")
        s(f"if col + {U(1)} < {dim}:")
        with s.block():
            s(f"{out}[ru, col + {U(1)}] = {second}")


class Packed16(_OperandKind):
    """float16 / bfloat16 on m16n8k16 (module docstring)."""
    word, float, word_bytes = "uint32", "float32", 4
    k_step = 16                   # contraction length of one mma
    chunk, per_word = 8, 2        # elements per 16-byte cp.async, per shared word

    def __init__(self, cfg):
        assert cfg.D % 16 == 0 and cfg.DV % 16 == 0 and cfg.BC % 16 == 0
        self.cfg = cfg
        self.mma, self.pack = "mma_" + cfg.DT, "pack_" + cfg.DT + "x2"
        self.lay = self.layout(cfg)

    @staticmethod
    def layout(cfg):
        QW = KW = cfg.D // 2 + 4
        if cfg.VEC:
            VW = cfg.DV // 2 + 4                 # V row-major: [BC][DV/2 + 4]
            return _layout(cfg, QW, KW, VW, cfg.BC * VW)
        VW = cfg.BC // 2 + 4                     # Vt: [DV][BC/2 + 4]
        return _layout(cfg, QW, KW, VW, cfg.DV * VW)

    # ---- scalar staging
    def _stage_q_scalar(self, s):
        self._stage_pairs(s, "qh", self.cfg.BR, "row", "i0", "Nq_u", 0, self.lay.QW)

    def _stage_pairs(self, s, src, rows, row, first, limit, off, W):
        """Scalar staging of rows x D elements, two adjacent columns per word."""
        D = self.cfg.D
        s(f"for idx in range(tid, {U(rows * D // 2)}, {U(self.cfg.NT)}):")
        with s.block():
            s(f"r = idx // {U(D // 2)}",
              f"w = idx % {U(D // 2)}",
              "c = w + w",
              f"{row} = {first} + r",
              f"word = {U(0)}",
              f"if {row} < {limit} and c < d_u:")
            with s.block():
                s(f"word = U({src}[{row}, c])",
                  f"if c + {U(1)} < d_u:")
                with s.block():
                    s(f"word |= U({src}[{row}, c + {U(1)}]) << {U(16)}")
            s(f"smem[{U(off)} + r * {U(W)} + w] = uint32(word)")

    def _stage_kv_scalar(self, s, j0u, k_off, v_off):
        c, L = self.cfg, self.lay
        self._stage_pairs(s, "kh", c.BC, "j", j0u, "Nk_u", k_off, L.KW)
        # V transposed: word (column c, key pair jp) holds keys 2 jp, 2 jp + 1
        s(f"for idx in range(tid, {U(c.DV * c.BC // 2)}, {U(c.NT)}):")
        with s.block():
            s(f"jp = idx // {U(c.DV)}",
              f"c = idx % {U(c.DV)}",
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
            s(f"smem[{U(v_off)} + c * {U(L.VW)} + jp] = uint32(word)")

    # ---- fragments and products
    def a_fragments(self, s, name="q", off=0, W=None):
        """Emit the per-thread bases of the A fragments of the warp's 16 rows of a row-major
        shared tile at word ``off`` with rows of W words (the forward's Q)."""
        c, W = self.cfg, W or self.lay.QW
        s(f"{name}base = {U(off)} + (warp * {U(16)} + g) * {U(W)} + t")
        if c.VEC:
            # ldmatrix.x4 for A: lanes 0-15 address rows 0-15 at column kk*16, lanes 16-31 the
            # same rows at column kk*16 + 8 -> registers a0..a3 in mma order
            s(f"{name}lm = shared_addr(smem, {U(off)} + (warp * {U(16)} + lane % {U(16)}) * "
              f"{U(W)} + (lane // {U(16)}) * {U(4)})")

    def load_a(self, s, kk, names, name="q", W=None):
        """Emit the A fragment of k-step kk into registers ``names``."""
        if self.cfg.VEC:
            s(f"{', '.join(names)} = ldmatrix_x4({name}lm + {U(kk * 32)})")
            return
        W = W or self.lay.QW
        offs = (kk * 8, 8 * W + kk * 8, kk * 8 + 4, 8 * W + kk * 8 + 4)
        for nm, off in zip(names, offs):
            s(f"{nm} = smem[{name}base + {U(off)}]")

    def b_fragments(self, s, kb, off, name="k", W=None):
        """Emit the bases of B fragments that contract over a row-major tile's columns (the
        forward's K in Q K^T: B col-major), at word ``kb`` + ``off``, rows of W words."""
        W = W or self.lay.KW
        if self.cfg.VEC:
            # ldmatrix.x4 for B of Q K^T (K row-major = B col-major): matrices
            # (n-tile n, k 0-7), (n, k 8-15), (n+1, k 0-7), (n+1, k 8-15)
            s(f"{name}lm = shared_addr(smem, {kb}{U(off)} + ((lane // {U(16)}) * {U(8)} + "
              f"lane % {U(8)}) * {U(W)} + ((lane // {U(8)}) % {U(2)}) * {U(4)})")
        else:
            s(f"{name}base = {kb}{U(off)} + g * {U(W)} + t")

    def load_b(self, s, kk, n, name="k", W=None):
        """Emit the B fragment for k-step kk, n8 tile n; returns its registers."""
        W = W or self.lay.KW
        if self.cfg.VEC:
            if n % 2 == 0:
                s(f"{name}b0, {name}b1, {name}b2, {name}b3 = "
                  f"ldmatrix_x4({name}lm + {U(4 * (n * 8 * W + kk * 8))})")
            return [f"{name}b0", f"{name}b1"] if n % 2 == 0 else [f"{name}b2", f"{name}b3"]
        s(f"{name}b0 = smem[{name}base + {U(n * 8 * W + kk * 8)}]",
          f"{name}b1 = smem[{name}base + {U(n * 8 * W + kk * 8 + 4)}]")
        return [f"{name}b0", f"{name}b1"]

    def accumulate_pv(self, s, kb, v_off, NVN, NPK, p="s", acc="o", name="v", W=None,
                      rescaled=True):
        """Emit O += P V for one key tile, P packed from the S fragments in registers; in general
        acc += P X for C fragments ``p`` (NPK k16 steps) and a row-major tile X contracted over
        its rows (ldmatrix.trans), at word ``kb`` + ``v_off`` with rows of W words."""
        W = W or self.lay.VW
        if self.cfg.VEC:
            # ldmatrix.x4.trans for B of P V from row-major V: matrices
            # (keys 0-7, n-tile n), (keys 8-15, n), (keys 0-7, n+1), (keys 8-15, n+1)
            s(f"{name}lm = shared_addr(smem, {kb}{U(v_off)} + (((lane // {U(8)}) % {U(2)}) * "
              f"{U(8)} + lane % {U(8)}) * {U(W)} + (lane // {U(16)}) * {U(4)})")
        else:
            s(f"{name}base = {kb}{U(v_off)} + g * {U(W)} + t")
        for kk in range(NPK):
            s(*packed_a_step(self.pack, p, kk, [f"pa{r}" for r in range(4)]))
            for n in range(NVN):
                if self.cfg.VEC:
                    if n % 2 == 0:
                        s(f"{name}b0, {name}b1, {name}b2, {name}b3 = ldmatrix_x4_trans("
                          f"{name}lm + {U(4 * (kk * 16 * W + n * 4))})")
                    b = [f"{name}b0", f"{name}b1"] if n % 2 == 0 else [f"{name}b2", f"{name}b3"]
                else:
                    s(f"{name}b0 = smem[{name}base + {U(n * 8 * W + kk * 8)}]",
                      f"{name}b1 = smem[{name}base + {U(n * 8 * W + kk * 8 + 4)}]")
                    b = [f"{name}b0", f"{name}b1"]
                self.product(s, [f"{acc}_{n}_{r}" for r in range(4)],
                             ["pa0", "pa1", "pa2", "pa3"], b)

    def store_o(self, s, n, ra, rb, half, acc="o", factor=None, out="oh", dim="dv_u"):
        """Emit the store of O tile n's registers ra, rb (row half), normalized, as 16-bit bits
        (in general accumulator ``acc`` times ``factor`` into ``out``'s columns below ``dim``)."""
        f = factor or f"inv{half}"
        self._store_pair(s, n, f"uint16(word & {U(0xFFFF)})", f"uint16(word >> {U(16)})",
                         [f"word = U({self.pack}({acc}_{n}_{ra} * {f}, {acc}_{n}_{rb} * {f}))"],
                         out, dim)


class Words(_OperandKind):
    """tf32 / float64: one element per shared-memory word on a 16x8x8 mma (module docstring)."""
    k_step = 8
    #: per kind: the word type, how an element becomes a word (and the zero word, and the store
    #: of ``word``), how a probability becomes an A operand, the V row pad in words, the float
    #: type and the mma
    KINDS = {
        "tf32": {"word": "uint32", "load": "U(to_tf32({}))", "zero": "U(0)",
                 "store": "uint32(word)", "p": "to_tf32({})", "v_pad": 4, "float": "float32",
                 "mma": "mma_tf32"},
        "f64": {"word": "float64", "load": "{}", "zero": "ZERO", "store": "word", "p": "{}",
                "v_pad": 2, "float": "float64", "mma": "mma_f64"},
        "3xtf32": {"word": "float32", "load": "{}", "zero": "ZERO", "store": "word", "p": None,
                   "v_pad": 4, "float": "float32", "mma": "mma_tf32"},
    }

    def __init__(self, cfg):
        assert cfg.D % 8 == 0 and cfg.DV % 8 == 0 and cfg.BC % 8 == 0
        assert not (cfg.VEC and cfg.DT == "tf32"), \
            "tf32 operands are rounded as they are staged (VEC=0)"
        self.cfg, self.kind = cfg, self.KINDS[cfg.DT]
        self.word, self.float, self.mma = self.kind["word"], self.kind["float"], self.kind["mma"]
        self.word_bytes = 8 if cfg.DT == "f64" else 4
        self.chunk, self.per_word = 16 // self.word_bytes, 1   # per 16-byte cp.async, per word
        self.lay = self.layout(cfg)

    @classmethod
    def layout(cls, cfg):
        QW = KW = cfg.D + 4
        VW = cfg.DV + cls.KINDS[cfg.DT]["v_pad"]
        return _layout(cfg, QW, KW, VW, cfg.BC * VW)

    def operand(self, s, name, expr):
        """Emit the read of one A/B operand register."""
        s(f"{name} = {expr}")

    # ---- scalar staging
    def _stage_q_scalar(self, s):
        c = self.cfg
        self._stage_rows(s, "qh", c.BR, "row", "i0", "Nq_u", 0, self.lay.QW, c.D, "d_u")

    def _stage_rows(self, s, src, rows, row, first, limit, off, W, width, dim):
        """Scalar staging of rows x width elements, one per word."""
        kind = self.kind
        s(f"for idx in range(tid, {U(rows * width)}, {U(self.cfg.NT)}):")
        with s.block():
            s(f"r = idx // {U(width)}",
              f"c = idx % {U(width)}",
              f"{row} = {first} + r",
              f"word = {kind['zero']}",
              f"if {row} < {limit} and c < {dim}:")
            with s.block():
                s("word = " + kind["load"].format(f"{src}[{row}, c]"))
            s(f"smem[{U(off)} + r * {U(W)} + c] = {kind['store']}")

    def _stage_kv_scalar(self, s, j0u, k_off, v_off):
        c, L = self.cfg, self.lay
        self._stage_rows(s, "kh", c.BC, "j", j0u, "Nk_u", k_off, L.KW, c.D, "d_u")
        self._stage_rows(s, "vh", c.BC, "j", j0u, "Nk_u", v_off, L.VW, c.DV, "dv_u")

    # ---- fragments and products
    def a_fragments(self, s, name="q", off=0, W=None):
        # A fragment of k-step kk: a0 = Q[g, 8kk+t], a1 = Q[g+8, 8kk+t], a2/a3 at column +4
        s(f"{name}base = {U(off)} + (warp * {U(16)} + g) * {U(W or self.lay.QW)} + t")

    def load_a(self, s, kk, names, name="q", W=None):
        W = W or self.lay.QW
        offs = (kk * 8, 8 * W + kk * 8, kk * 8 + 4, 8 * W + kk * 8 + 4)
        for nm, off in zip(names, offs):
            self.operand(s, nm, f"smem[{name}base + {U(off)}]")

    def b_fragments(self, s, kb, off, name="k", W=None):
        # B fragment b0 = K[n8 + g, 8kk + t], b1 at column + 4
        s(f"{name}base = {kb}{U(off)} + g * {U(W or self.lay.KW)} + t")

    def load_b(self, s, kk, n, name="k", W=None):
        W = W or self.lay.KW
        self.operand(s, f"{name}b0", f"smem[{name}base + {U(n * 8 * W + kk * 8)}]")
        self.operand(s, f"{name}b1", f"smem[{name}base + {U(n * 8 * W + kk * 8 + 4)}]")
        return [f"{name}b0", f"{name}b1"]

    def _v_fragments(self, s, kb, v_off, name="v", W=None):
        # B = (V[8kk + 2t, n8 + g], V[8kk + 2t + 1, n8 + g]): the permuted contraction index
        s(f"{name}base = {kb}{U(v_off)} + t * {U(2 * (W or self.lay.VW))} + g")

    def _load_v(self, s, kk, n, name="v", W=None):
        W = W or self.lay.VW
        self.operand(s, f"{name}b0", f"smem[{name}base + {U(kk * 8 * W + n * 8)}]")
        self.operand(s, f"{name}b1", f"smem[{name}base + {U(kk * 8 * W + W + n * 8)}]")
        return [f"{name}b0", f"{name}b1"]

    def accumulate_pv(self, s, kb, v_off, NVN, NPK, p="s", acc="o", name="v", W=None,
                      rescaled=True):
        """Emit O += P V for one key tile; A = (P[g, 2t], P[g+8, 2t], P[g, 2t+1], P[g+8, 2t+1])
        of key tile kk (the permuted contraction index). In general acc += P X for C fragments
        ``p`` and a row-major tile X contracted over its rows."""
        self._v_fragments(s, kb, v_off, name, W)
        for kk in range(NPK):
            pa = [self.kind["p"].format(f"{p}_{kk}_{r}") for r in (0, 2, 1, 3)]
            s(*(f"pa{i} = {x}" for i, x in enumerate(pa)))
            for n in range(NVN):
                b = self._load_v(s, kk, n, name, W)
                self.product(s, [f"{acc}_{n}_{r}" for r in range(4)],
                             [f"pa{i}" for i in range(4)], b)

    def store_o(self, s, n, ra, rb, half, acc="o", factor=None, out="oh", dim="dv_u"):
        self.store_floats(s, n, ra, rb, half, acc, factor, out, dim)


class Split3xTF32(Words):
    """float32 as 3xTF32 (module docstring): operands split as read, three mma per product, small
    terms accumulated apart, each key tile's P V added to O in float32."""
    rescales_o_in_softmax = False   # O is rescaled where each tile's P V is added

    def operand(self, s, name, expr):
        """Read one operand register, split into name_h, name_l."""
        s(f"{name}_h, {name}_l = split_tf32({expr})")

    def product(self, s, acc, a, b, small=None):
        """Emit acc += A B: the two small terms A_l B_h + A_h B_l go to ``small`` (kept apart
        from acc, so their 2**-11-sized sums are not truncated against acc's magnitude) and
        A_h B_h to acc."""
        for sa, sb, into in (("_l", "_h", small), ("_h", "_l", small), ("_h", "_h", acc)):
            ops = ", ".join([x + sa for x in a] + [x + sb for x in b])
            s(f"{', '.join(into)} = {self.mma}({ops}, {', '.join(into)})")

    def zero_scores(self, s, NN, acc="s", small="c"):
        for n in range(NN):
            for name in (acc, small):
                s(", ".join(f"{name}_{n}_{r}" for r in range(4)) + " = ZERO, ZERO, ZERO, ZERO")

    def finish_scores(self, s, NN, acc="s", small="c"):
        for n in range(NN):
            s(*(f"{acc}_{n}_{r} += {small}_{n}_{r}" for r in range(4)))

    def accumulate_pv(self, s, kb, v_off, NVN, NPK, p="s", acc="o", name="v", W=None,
                      rescaled=True):
        """Each n8 tile of this key tile's P V into fresh accumulators, added to the rescaled O
        in float32: O never goes through the tensor cores' truncating accumulation, so its error
        does not grow with the number of keys. (``rescaled=False``: acc += P X, no alpha.)"""
        self._v_fragments(s, kb, v_off, name, W)
        for kk in range(NPK):
            for i, r in enumerate((0, 2, 1, 3)):
                self.operand(s, f"pa_{kk}_{i}", f"{p}_{kk}_{r}")
        for n in range(NVN):
            s("pv0, pv1, pv2, pv3 = ZERO, ZERO, ZERO, ZERO",
              "pc0, pc1, pc2, pc3 = ZERO, ZERO, ZERO, ZERO")
            for kk in range(NPK):
                b = self._load_v(s, kk, n, name, W)
                self.product(s, [f"pv{r}" for r in range(4)],
                             [f"pa_{kk}_{i}" for i in range(4)], b, [f"pc{r}" for r in range(4)])
            for r in range(4):
                scaled = f"{acc}_{n}_{r} * alpha{r // 2}" if rescaled else f"{acc}_{n}_{r}"
                s(f"{acc}_{n}_{r} = {scaled} + (pv{r} + pc{r})")


def operands_for(cfg):
    """The operand kind of a config."""
    if cfg.DT in ("f16", "bf16"):
        return Packed16(cfg)
    return Split3xTF32(cfg) if cfg.DT == "3xtf32" else Words(cfg)

