"""Writing kernel source: the line buffer with indentation, constants, and the pieces every
tensor-core kernel opens with (thread and block indices, per-head views, each thread's rows and
how many keys they see).

Every register of a fragment is a scalar variable of the generated source, so nothing lives in
local memory; numba compiles the text like any hand-written kernel (``print`` it to read it).
"""
import linecache

_defined = [0]


def define(src, label, cfg, namespace, name):
    """Execute generated source in ``namespace`` and return its function ``name``; the source is
    registered with linecache under a name carrying ``label`` and the config, so tracebacks and
    ``inspect`` show the generated lines."""
    _defined[0] += 1
    filename = f"<{label} {' '.join(f'{k}{v}' for k, v in cfg.items())} #{_defined[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


class Source:
    """Lines of generated Python with the current indentation; ``with s.block():`` indents."""

    def __init__(self):
        self.lines = []
        self.ind = 0

    def __call__(self, *lines):
        for line in lines:
            self.lines.append("    " * self.ind + line)

    def block(self):
        src = self

        class _Indented:
            def __enter__(self):
                src.ind += 1

            def __exit__(self, *exc):
                src.ind -= 1
        return _Indented()

    def text(self):
        return "\n".join(self.lines) + "\n"


def U(n):
    """A uint64 constant in generated source (int literals are int64 in numba, and uint64 mixed
    with int64 becomes float64)."""
    return f"U({int(n)})"


def emit_thread_indices(s, flt):
    """Emit the scales (they arrive as float64, launch.py's ABI, and become ``flt``), the sizes
    and the thread's warp, lane and fragment coordinates g, t."""
    s(f"scale_log2 = {flt}(scale_log2_in)", f"scale = {flt}(scale_in)",
      "H = q.shape[1]", "Nq = q.shape[2]", "Hkv = k.shape[1]", "Nk = k.shape[2]",
      "Nq_u = U(Nq)", "Nk_u = U(Nk)",
      "d_u = U(q.shape[3])", "dv_u = U(v.shape[3])",
      "tid = U(cuda.threadIdx.x)",
      f"warp = tid // {U(32)}",
      f"lane = tid % {U(32)}",
      f"g = lane // {U(4)}",
      f"t = lane % {U(4)}")


def emit_prologue(s, BR, flt, word, views=("qh = q[b, h]", "kh = k[b, hk]", "vh = v[b, hk]",
                                           "oh = out[b, h]"), packed=False, div32=None):
    """Emit the thread / block indices of a kernel whose blocks own BR query rows, the per-head
    ``views`` and the shared array (``word`` elements); ``packed``: b is a packed sequence
    (emit_sequence). ``div32``: the name of a 32-bit unsigned division to split the block's
    batch, head and K/V head with (a 64-bit division is a subroutine call on the GPU, which
    makes ptxas serialize wgmma: cuda.wgmma)."""
    emit_thread_indices(s, flt)
    s(  # last Q block first: under causal masking it is the longest, so the tail is short
      f"qb = U(cuda.gridDim.x) - {U(1)} - U(cuda.blockIdx.x)",
      "bh = U(cuda.blockIdx.y)")
    if div32:
        s(f"b = U({div32}(bh, H))",
          "h = bh - b * U(H)",
          f"hk = U({div32}(h, {div32}(H, Hkv)))")
    else:
        s("b = bh // U(H)",
          "h = bh % U(H)",
          "hk = kv_head(h, U(H), U(Hkv))")
    s(f"i0 = qb * {U(BR)}")
    if packed:
        emit_sequence(s, "i0", "Nq_u")
    s(*views,
      f"smem = cuda.shared.array(0, {word})")


#: the kernel arguments of packed sequences (MmaConfig.VARLEN): the B + 1 cumulative row counts
#: of the packed queries and keys (int32), sequence b's rows being cu[b] ... cu[b + 1]
VARLEN_ARGUMENTS = ", cu_q, cu_k"


def emit_sequence(s, first, limit):
    """Emit, for packed sequences (MmaConfig.VARLEN), where sequence b's query and key rows start
    (q_lo, k_lo), their counts Nq, Nk (and unsigned twins) and its causal offset (the
    causal_offset argument gives the alignment: 0 top-left, else bottom-right, Nk - Nq), then
    the return of a block whose first row ``first`` is at or past ``limit``: the longest
    sequence sized the grid, so shorter ones leave blocks with nothing to do."""
    s("q_lo = I(cu_q[b])", "k_lo = I(cu_k[b])",
      "Nq = I(cu_q[b + U(1)]) - q_lo", "Nk = I(cu_k[b + U(1)]) - k_lo",
      "Nq_u = U(Nq)", "Nk_u = U(Nk)",
      "causal_offset = Nk - Nq if causal_offset != 0 else I(0)",
      f"if {first} >= {limit}:")
    with s.block():
        s("return")


def emit_views_at_use(s, cfg, views):
    """Emit, for packed sequences (VARLEN), the ``views`` ((name, array, head, rows), ...) where
    they are used (an epilogue's stores, a tile's staging): their sequence's first row is loaded
    again from cu_q / cu_k (the tile loop's barriers and cp.async clobber memory, so the load is
    not merged with the prologue's) instead of a 64-bit pointer per view held in registers
    through the loop (unpacked, the pointers come from kernel parameters and cost nothing to
    keep; packed, they cost a block of occupancy at d64: bench/NOTES.md). Without VARLEN the
    prologue made them."""
    if not cfg.VARLEN:
        return
    for rows in sorted({rows for _, _, _, rows in views}):
        s(f"{rows}_lo = I(cu_{rows}[b])")
    s(*(f"{name} = {head_view(cfg, array, head, rows)}" for name, array, head, rows in views))


def head_view(cfg, array, head, rows="q"):
    """Source of one head's rows of ``array`` (a view): array[b, head], or with VARLEN sequence
    b's rows of the packed array (``rows``: "q" or "k", the rows it is packed like)."""
    if not cfg.VARLEN:
        return f"{array}[b, {head}]"
    return f"{array}[0, {head}, {rows}_lo:{rows}_lo + N{rows}]"


def row_value(cfg, array, head, row):
    """Source of query row ``row``'s entry of a per-row array (lse, delta) of one head."""
    if not cfg.VARLEN:
        return f"{array}[b, {head}, {row}]"
    return f"{array}[0, {head}, q_lo + I({row})]"
