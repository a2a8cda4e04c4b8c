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
                                           "oh = out[b, h]")):
    """Emit the thread / block indices of a kernel whose blocks own BR query rows, the per-head
    ``views`` and the shared array (``word`` elements)."""
    emit_thread_indices(s, flt)
    s(  # last Q block first: under causal masking it is the longest, so the tail is short
      f"qb = U(cuda.gridDim.x) - {U(1)} - U(cuda.blockIdx.x)",
      "bh = U(cuda.blockIdx.y)",
      "b = bh // U(H)",
      "h = bh % U(H)",
      "hk = kv_head(h, U(H), U(Hkv))",
      f"i0 = qb * {U(BR)}",
      *views,
      f"smem = cuda.shared.array(0, {word})")
