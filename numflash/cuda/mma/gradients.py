"""cuda.mma's backward operator: the config for a problem (or why not), the compiled kernels and
the launch of backward.py's two passes.

The query pass writes dQ and delta = rowsum(dO * O) (B x H x Nq in the lse's precision, the
only extra device memory), the key pass dK and dV, each in the inputs' dtype (or, for 16-bit
inputs with grad_dtype float32, in float32 as accumulated: MmaConfig.GRAD32), with no atomics
and no float32 gradient buffers (two runs are bitwise equal). Every operand kind of the forward
runs: float16 / bfloat16, float32 as 3xTF32, float64.

16-bit inputs on sm_90 without ``deterministic=True`` take dQ by adds (dq_adds, MmaConfig.DQADD):
the key pass adds dS K into a float32 B x H x Nq x D accumulator and the query pass computes
delta only, 5 matrix products instead of 7.
"""
import dataclasses
import math

from ...device import Unsupported
from ...mods import bias_grad_accumulator, compile_errors
from .backward import bias_accumulator_type, make_key_kernel, make_query_kernel, shared_bytes
from . import dropout, mods
from .config import (check_block_tiles, check_packed, dropped, modifications, padded_dims,
                     vector_ok)
from .tiles import NAME, X3_CCS, MmaConfig

#: the gradient columns one block holds, by operand kind: the key pass keeps dK and dV
#: fragments (D / 2 + DV / 2 values per thread) and the tile's S and dP in registers; at 256
#: (16-bit, float32) or 128 (float64, two registers a value) that is past the 255 a thread may
#: hold. Wider head dims split the columns over gridDim.z (MmaConfig.CHUNKS), each block
#: recomputing S and dP for its slice.
COLUMNS_PER_BLOCK = {"f16": 128, "bf16": 128, "3xtf32": 128, "f64": 64}

#: (NW, BC, SUB) of the query pass and of the key pass by largest padded head dim, fastest
#: first, then one for less shared memory (sm_86 / 89 / 12x give a block 99 KB). BC: the
#: streamed tile's rows (keys in the query pass, queries in the key pass); SUB: the key pass
#: takes its tile SUB queries at a time (S^T, dP^T of SUB columns in registers with dK, dV).
#: Timed on the H100 (bench/backward_tiles.py, B4 H16 N4096 float16, bench/NOTES.md): key pass
#: d64 (4, 128, 64) 2.50 ms against (4, 64) 3.02; d128 (8, 64, 16) 6.00 ms against (4, 16)
#: 8.52; query pass (4, 64) within 2% of (8, 64), ahead of (4, 32). ptxas fits each in 255
#: registers with no spill on sm_80 and sm_90 (the compile tests check it).
TILES = {64: {"queries": [(4, 64, 0)], "keys": [(4, 128, 64), (4, 64, 0)]},
         128: {"queries": [(4, 64, 0), (4, 32, 0)], "keys": [(8, 64, 16), (4, 32, 16)]}}
#: With a sliding window the key pass keeps a few more integers live: at d128 (8, 64, 16)
#: spills 12 bytes on sm_90 (ptxas, session 11), (8, 32, 16) none.
WINDOW_TILES = {128: {"keys": [(8, 32, 16), (4, 32, 16)]}}
#: With score modifications (their arguments and each score's indices live too; compile sweep
#: with every built-in, ptxas session 12): the d64 key pass takes its 128 staged queries 32 at
#: a time (64 at a time spills 144 bytes on sm_90), the d128 query pass a tile of 32 keys
#: (spill-free), the d128 key pass (4, 32, 16), the least-spilling tile found (208 bytes on
#: sm_90; (8, 64, 16) spills 296): dK and dV alone take 128 registers a thread there.
MODS_TILES = {64: {"keys": [(4, 128, 32), (4, 64, 32)]},
              128: {"queries": [(4, 32, 0)], "keys": [(4, 32, 16)]}}


#: The 16-bit key pass's tiles with dQ by adds (DQADD), by largest padded head dim: 8 warps
#: (128 keys a block, half the dQ adds of 64) and, at d128, 32 queries a sub-tile (half the
#: barriers of 16). H100, B4 H16 N4096 float16, bench/backward_tiles.py, whole backward (bench/
#: NOTES.md "dQ by adds"): d64 (8, 128, 64) 4.37 ms against (4, 128, 64) 4.70 and the two
#: passes' 5.10; d128 (8, 64, 32) 7.64 ms against (8, 64, 16) 9.32 and 10.10, though ptxas
#: spills 80 bytes there (the compile test holds it).
DQADD_TILES = {64: (8, 128, 64), 128: (8, 64, 32)}

#: the operand kind of each input dtype (operands.py): float32 as 3xTF32 (float32-level
#: accuracy; precision="ieee" keeps it on the FMA units), float64 on float64 tensor cores
KINDS = {"float16": "f16", "bfloat16": "bf16", "float32": "3xtf32", "float64": "f64"}

#: The word kinds' tiles, by (kind, largest padded head dim), fastest first where timed: a value
#: takes one register (3xTF32, which also splits each operand in two and keeps its small terms
#: apart) or two (float64), so the tiles are narrower than the 16-bit ones and the key pass
#: takes its queries 8 or 16 at a time (one or two k-steps of m16n8k8). ptxas (sm_90, session
#: 16, bench/NOTES.md "Tensor-core backward for float32 and float64"): 3xTF32 d64 (4, 64) 237
#: registers (239 with the lent H100's nvJitLink) and (4, 64, 16) 255, no spill (8 bytes
#: there), 22.4 ms for B4 H16 N4096 there; d128 (4, 32) spilled 24 bytes, (4, 16) 166
#: registers and none, the key pass (4, 32, 8) 32 bytes, (4, 16, 8) 8; float64 d64 query pass
#: (4, 32) 243 registers, none, the key pass 96-124 bytes with every tile tried (dK and dV take
#: 128 registers). Windows and modifications take the same tiles (a window's bounds add 8 bytes
#: of spill to the 3xTF32 d64 key pass and 84 to float64's on sm_90).
#: The last tile of each is for less shared memory (wide rows: a CHUNKS variant stages whole
#: rows of q, k, v, dO though it holds a slice of the gradients' columns).
WORD_TILES = {
    ("3xtf32", 64): {"queries": [(4, 64, 0), (4, 32, 0)], "keys": [(4, 64, 16), (4, 32, 16)]},
    ("3xtf32", 128): {"queries": [(4, 16, 0), (2, 16, 0)], "keys": [(4, 16, 8), (2, 16, 8)]},
    ("f64", 64): {"queries": [(4, 32, 0), (4, 16, 0), (2, 16, 0)],
                  "keys": [(4, 32, 8), (4, 16, 8), (2, 16, 8)]},
}


def column_chunks(D, DV, DT):
    """How many slices of the gradients' columns the blocks of a backward pass split for
    padded head dims D, DV (1: none): the fewest that keep each within COLUMNS_PER_BLOCK."""
    chunks = 1
    while max(D, DV) // chunks > COLUMNS_PER_BLOCK[DT]:
        chunks *= 2
    return chunks


def _tile_size(D, DV, chunks):
    """The key of the tile tables for padded head dims D, DV split in ``chunks`` column slices:
    64 or 128, the gradients' columns a block holds."""
    return 64 if max(D, DV) // chunks <= 64 else 128


def tiles(D, DV, smem_limit=None, window=False, mods=False, DT="f16", cc=None):
    """{"queries": MmaConfig, "keys": MmaConfig} of operand kind DT for padded head dims
    (``window``: the WINDOW variants; ``mods``: with score modifications; ``cc``: the compute
    capability, which picks float64's mma form): per pass the first tile of TILES (or
    WINDOW_TILES, MODS_TILES; WORD_TILES for 3xTF32 and float64) whose shared memory fits
    ``smem_limit`` (else the last, which config() refuses)."""
    chosen = {}
    chunks = column_chunks(D, DV, DT)
    size = _tile_size(D, DV, chunks)
    form = None
    if DT == "f64":   # as the forward (config.py): m16n8k8 only where sm_90 is known
        form = "m16n8k8" if cc is not None and cc >= (9, 0) else "m8n8k4"
    table = WORD_TILES[(DT, size)] if DT in ("3xtf32", "f64") else TILES[size]
    for kernel, candidates in table.items():
        if DT in ("f16", "bf16"):
            if window:
                candidates = WINDOW_TILES.get(size, {}).get(kernel, candidates)
            if mods:
                candidates = MODS_TILES.get(size, {}).get(kernel, candidates)
        for NW, BC, SUB in candidates:
            cfg = MmaConfig(D, DV, NW, BC, 0, DT, 1, MMA=form, SUB=SUB, WINDOW=int(window),
                            CHUNKS=chunks if chunks > 1 else 0)
            if smem_limit is None or shared_bytes(cfg, kernel) <= smem_limit:
                break
        chosen[kernel] = cfg
    return chosen


def config(problem, device):
    """{"queries": MmaConfig, "keys": MmaConfig} for a backward problem; raises Unsupported
    saying why not (the operator's declarations were checked before)."""
    DT = KINDS[problem.dtype_name]
    B, H, Nq, Nk, d, dv = problem.shape
    D, DV, window = padded_dims(problem)
    chunks = column_chunks(D, DV, DT)
    # padded head dims (32, 64, 96, 128, 256) always slice into whole mma tiles
    assert D % (16 * chunks) == 0 and DV % (16 * chunks) == 0 or DT not in ("f16", "bf16")
    assert D % (8 * chunks) == 0 and DV % (8 * chunks) == 0
    if DT == "3xtf32" and getattr(problem, "precision", "auto") == "tf32":
        raise Unsupported(f"{NAME}'s backward computes float32 as 3xTF32 (float32-level "
                          "accuracy); one tf32 mma per product (precision='tf32') has no "
                          "backward kernel: pass precision='auto' for the 3xTF32 one")
    if DT == "3xtf32" and device.cc is not None and device.cc not in X3_CCS:
        raise Unsupported(f"{NAME}'s backward runs float32 as 3xTF32 only on compute capability "
                          f"8.0 / 9.0, where tf32 tensor cores outrun the FMA units ~8x; on "
                          f"{device.name} cuda.row's backward takes it")
    why = staging_refusal(problem)
    if why:
        raise Unsupported(f"{NAME}'s backward stages q, k, v, dO and O with 16-byte cp.async, "
                          f"and {why} (a contiguous last axis, head dims that are multiples of "
                          f"{16 // problem.q.itemsize} and 16-byte aligned rows take it; "
                          "cuda.row's backward takes any layout)")
    token = modifications(problem)
    packed = getattr(problem, "varlen", None) is not None
    if packed:
        check_packed(problem)
    # float32 gradients of 16-bit inputs: the accumulators stored unrounded
    grad32 = DT in ("f16", "bf16") and str(getattr(problem, "grad_dtype", None)) == "float32"
    drop = dropped(problem)
    # dropout's key pass runs the elementwise path of modifications: their tiles
    cfg = {kernel: dataclasses.replace(c, MODS=token, VARLEN=int(packed), GRAD32=int(grad32),
                                       DROP=int(drop))
           for kernel, c in tiles(D, DV, device.smem_per_block_optin, window,
                                  bool(token) or drop, DT, device.cc).items()}
    bias_mode = bias_grad_mode(problem)
    if bias_mode:
        cfg["keys"] = with_bias_grad(cfg["keys"], bias_mode)
    arg_token = mod_args_grad_token(problem)
    if arg_token:
        cfg["keys"] = dataclasses.replace(cfg["keys"], MARGS=arg_token)
    adds = dq_adds(problem, cfg["keys"], device)
    if adds:
        cfg = with_dq_adds(cfg, adds, device.smem_per_block_optin)
    check_block_tiles(problem, ((cfg["queries"].BR, cfg["queries"].BC, "backward's query pass"),
                                (cfg["keys"].BC, cfg["keys"].BR, "backward's key pass")))
    for kernel, c in cfg.items():
        need = shared_bytes(c, kernel)
        if need > device.smem_per_block_optin:
            raise Unsupported(f"{NAME}'s backward {kernel} pass needs {need} bytes of shared "
                              f"memory for d={d}, dv={dv}, more than the "
                              f"{device.smem_per_block_optin} a block may use on {device.name}")
    return cfg


def staging_refusal(problem):
    """Why q, k, v, dO and O cannot be staged with 16-byte cp.async (the tensor-core backwards'
    staging), or None. explain(..., backward=True) plans before there are dO and O: they are
    checked when given."""
    staged = ("q", "k", "v") + tuple(n for n in ("do", "o")
                                     if getattr(problem, n, None) is not None)
    return vector_ok(problem, staged) if problem.on_device else "these are not device arrays"


def dq_adds(problem, keys, device):
    """The DQADD form of dQ for a problem whose key pass has config ``keys`` ("" for the two
    passes): "red4" (the key pass adds dQ into a float32 accumulator with four-float reductions)
    for 16-bit inputs on sm_90, unless ``deterministic=True`` asks for bitwise-repeatable
    gradients. Windows, modifications, dropout and packed sequences take it too: each checked
    against the float64 reference on the H100 and faster than the two passes there (B4 H16
    N4096, float16 d64 / d128 and bfloat16 d128; packed: 8 sequences, 16384 rows; bench/NOTES.md
    "dQ by adds with the options"): a window 1.09-1.20x, score / mask modifications 1.37-1.81x
    (the two passes' modification tiles are slow; the adds' tile spills up to 540 bytes and
    still wins), dropout 1.21-1.39x, packed sequences 1.05-1.13x. Not with column slices
    (CHUNKS: every slice would add dQ), attn_bias's gradient (DBIAS), a block mask's lists
    or mod_args' gradients (MARGS): none of those was timed."""
    if getattr(problem, "deterministic", False) or keys.DT not in ("f16", "bf16"):
        return ""
    if keys.CHUNKS or keys.DBIAS or keys.MARGS or \
            any(part.startswith("block:") for part in keys.MODS.split("+")):
        return ""
    if device.cc is None or device.cc < (9, 0):   # red.global.add.v4.f32 is sm_90's
        return ""
    from .. import dq_round
    B, H, Nq = problem.shape[:3]
    if not dq_round.fits(B * H * Nq, keys.D):   # (a packed problem's B is 1)
        return ""
    return "red4"


def with_dq_adds(cfg, mode, smem_limit):
    """The pair of configs ``cfg`` with dQ by adds in DQADD ``mode``: the key pass on
    DQADD_TILES where its shared memory fits ``smem_limit`` (else on its own tile)."""
    keys = dataclasses.replace(cfg["keys"], DQADD=mode)
    NW, BC, SUB = DQADD_TILES[_tile_size(keys.D, keys.DV, keys.CHUNKS or 1)]
    tiled = dataclasses.replace(keys, NW=NW, BC=BC, SUB=SUB)
    if shared_bytes(tiled, "keys") <= smem_limit:
        keys = tiled
    return {"queries": dataclasses.replace(cfg["queries"], DQADD=mode), "keys": keys}


#: DBIAS "rows" keeps two more sums a thread: the 16-bit d64 key pass then takes its staged
#: queries 16 at a time (ptxas, sm_90 f16, session 21: SUB 32 spilled 8-16 bytes, (4, 64, 32)
#: 16; (4, 128, 16) 230 registers, none)
ROWS_SUB = 16


def with_bias_grad(keys, mode):
    """The key pass's config ``keys`` with attn_bias's gradient in DBIAS ``mode``."""
    sub = min(keys.SUB, ROWS_SUB) if mode == "rows" and keys.DT in ("f16", "bf16") and \
        keys.SUB else keys.SUB
    return dataclasses.replace(keys, DBIAS=mode, SUB=sub)


def bias_grad_mode(problem):
    """The key pass's DBIAS mode (backward.BIAS_MODES), "" when attn_bias's gradient is not
    asked for; raises Unsupported where cuda.mma cannot compute it. A full (B, H, Nq, Nk) bias
    gets one write an element ("store"); one broadcast along the batch or the heads sums at
    most B x H pairs an element, as naive attention's gradient would, in float32 ("f32";
    float64 for float64 inputs); one shared by the queries (a key-padding bias) sums its
    column in registers ("rows"); one shared by the keys up to Nk pairs an element in float64
    ("f64"). A broadcast bias's sums end in atomic adds whose order varies from run to run."""
    if getattr(problem, "dbias", None) is None:
        return ""
    if getattr(problem, "varlen", None) is not None:
        raise Unsupported(f"{NAME}'s backward does not compute attn_bias's gradient for packed "
                          f"sequences; the CPU path does (one call per sequence)")
    B, H, Nq, Nk = problem.shape[:4]
    shape4 = (1,) * (4 - problem.dbias.ndim) + tuple(problem.dbias.shape)
    broadcast = any(n == 1 and f > 1 for n, f in zip(shape4, (B, H, Nq, Nk)))
    if broadcast and getattr(problem, "deterministic", False):
        raise Unsupported(f"{NAME}'s backward sums a broadcast attn_bias's gradient (shape "
                          f"{tuple(problem.dbias.shape)}) with atomic adds, in an order that "
                          f"varies: deterministic=True takes a full (B, H, Nq, Nk) bias here, "
                          f"or any bias on the CPU path")
    if shape4[2] == 1 and Nq > 1:
        return "rows"
    if shape4[3] == 1 and Nk > 1:
        return "f64"
    return ("f32" if broadcast else "store") if problem.dtype_name != "float64" else (
        "f64" if broadcast else "store")


def mod_args_grad_token(problem):
    """The key pass's MARGS token ("" when mod_args' gradients are not asked for); raises
    Unsupported where cuda.mma cannot compute them."""
    if getattr(problem, "dmod_args", None) is None:
        return ""
    if getattr(problem, "deterministic", False):
        raise Unsupported(f"{NAME}'s backward adds mod_args' gradients atomically, in an order "
                          f"that varies: deterministic=True takes them on the CPU path")
    return mods.arg_grad_token(problem.mods)


def signature(dtype, kernel, window=False, token="", varlen=False, grad32=False, drop=False,
              bias_mode="", dq_adds=False, arg_token=""):
    """Argument types of the "queries" or "keys" kernel: q, k, v, dO (and O for the query pass)
    (16-bit inputs as their bits), lse and delta (float32; float64 for float64), dQ or dK, dV
    (like q; float32 with ``grad32``), the exp2 and natural scales, causal, causal_offset (and
    with a window its left and right sizes, packed sequences' cu_q and cu_k, with
    modifications their arguments: mods.argument_types, with dropout its arguments, and with
    ``bias_mode`` (a DBIAS mode) the key pass's attn_bias gradient accumulator, a 4-d array of
    its float type; with ``arg_token`` (MARGS) the key pass's float64 accumulators of the
    trained mod_args (their dims) and its int32 index flag; with ``dq_adds``, the DQADD key
    pass's float32 dQ accumulator)."""
    from numba import types
    from ...inputs import lse_dtype
    from ..launch import array_type
    # 16-bit inputs as their bits (by name: np.dtype("bfloat16") needs ml_dtypes)
    arr = array_type("uint16" if str(dtype) in ("float16", "bfloat16") else dtype)
    rows = array_type(lse_dtype(dtype), 3)
    inputs = (arr,) * (5 if kernel == "queries" else 4)
    grad = array_type("float32") if grad32 else arr
    grads = (grad,) if kernel == "queries" else (grad, grad)
    return (*inputs, rows, rows, *grads, types.float64, types.float64, types.int64,
            types.int64) + ((types.int64, types.int64) if window else ()) + \
        ((array_type("int32", 1),) * 2 if varlen else ()) + mods.argument_types(token) + \
        dropout.argument_types(drop) + \
        ((array_type(bias_accumulator_type(bias_mode, KINDS.get(str(dtype)))),)
         if bias_mode else ()) + \
        (tuple(array_type("float64", n) for n in mods.arg_grad_ndims(token, arg_token)) +
         (array_type("int32", 1),) if arg_token and kernel == "keys" else ()) + \
        ((array_type("float32"),) if dq_adds and kernel == "keys" else ())


def compiled_kernels(cfg, dtype):
    """[(Kernel, numba argument types)] run() launches: the query pass, then the key pass (and,
    with DQADD, cuda.dq_round's)."""
    from .. import launch
    return [query_pass_kernel(cfg["queries"], dtype),
            (launch.get_kernel(NAME + ".backward_keys", make_key_kernel, cfg["keys"]),
             _signature(dtype, "keys", cfg["keys"]))] + dq_round_kernel(cfg, dtype)


def dq_round_kernel(cfg, dtype):
    """[(Kernel, argument types)] of cuda.dq_round for a DQADD backward config, else []."""
    if not cfg["keys"].DQADD:
        return []
    from .. import dq_round
    return [dq_round.kernel("float32" if cfg["queries"].GRAD32 else str(dtype))]


def query_pass_kernel(queries, dtype):
    """(Kernel, numba argument types) of the query pass of config ``queries`` (with DQADD: the
    delta pass another key pass may follow, as cuda.wgmma's does)."""
    from .. import launch
    return (launch.get_kernel(NAME + ".backward_queries", make_query_kernel, queries),
            _signature(dtype, "queries", queries))


def _signature(dtype, kernel, c):
    return signature(dtype, kernel, c.WINDOW, c.MODS, bool(c.VARLEN), bool(c.GRAD32),
                     bool(c.DROP), c.DBIAS, bool(c.DQADD), c.MARGS)


def run(problem, cfg, device):
    """Fill problem.dq, dk, dv (and dbias when asked for) for a normalized CuPy problem."""
    launch_passes(problem, cfg, device, [kernel for kernel, _ in
                                         compiled_kernels(cfg, problem.dtype_name)[:2]],
                  (shared_bytes(cfg["queries"], "queries"), shared_bytes(cfg["keys"], "keys")))


def launch_passes(problem, cfg, device, kernels, smem):
    """Launch the query pass and the key pass (``kernels``, with ``smem`` bytes of shared memory
    each: cuda.mma's, or another key pass that takes the DQADD key pass's arguments and reads
    the same config fields, as cuda.wgmma's does) and fill the problem's gradients."""
    import cupy
    from .. import dq_round, fastpath
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    # 16-bit kernels take the bits; 3xTF32 and float64 read their inputs as they are
    bits = (lambda a: a.view(cupy.uint16)) if cfg["queries"].DT in ("f16", "bf16") else \
        (lambda a: a)
    with cupy.cuda.Device(p.q.device.id):     # on the arrays' GPU, not the current one
        # rowsum(dO * O), in the lse's precision: the query pass writes it
        delta = fastpath.note_scratch(cupy.empty((B, H, Nq), p.lse.dtype))
        # DQADD: dQ's float32 accumulator, at the padded head dim (whole mma tiles)
        dq_acc = fastpath.note_scratch(cupy.zeros(p.q.shape[:3] + (cfg["keys"].D,),
                                                  cupy.float32), zeroed=True) \
            if cfg["keys"].DQADD else None
        bias_args = ()
        if cfg["keys"].DBIAS or cfg["keys"].MARGS:   # CuPy work on their accumulators below
            fastpath.note_unreplayable("attn_bias's or mod_args' gradients")
        if cfg["keys"].DBIAS:
            acc, view = bias_grad_accumulator(cupy, p.dbias, (B, H, Nq, Nk), cupy.dtype(
                bias_accumulator_type(cfg["keys"].DBIAS, cfg["keys"].DT)))
            bias_args = (view,)
        # MARGS: float64 sums of the trained mod_args' gradients, and the bad-index flag
        arg_accs = tuple(cupy.zeros(g.shape, cupy.float64) for g in p.dmod_args
                         if g is not None) if cfg["keys"].MARGS else ()
        arg_args = arg_accs + (cupy.zeros(1, cupy.int32),) if arg_accs else ()
    lse = p.lse
    qc, kc = cfg["queries"], cfg["keys"]
    scalars = (float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
               int(p.causal_offset))
    if cfg["queries"].WINDOW:
        scalars += tuple(int(w) for w in p.mods.window)
    query_grid, key_grid = (-(-Nq // qc.BR), B * H), (-(-Nk // kc.BR), B * p.k.shape[1])
    if qc.VARLEN:
        alignment, offsets = p.varlen.arguments()
        scalars = scalars[:3] + (alignment,) + scalars[4:] + offsets
        query_grid = p.varlen.grid(qc.BR, H)
        key_grid = p.varlen.grid(kc.BR, p.k.shape[1], keys=True)
    if cfg["queries"].MODS:
        scalars += mods.arguments(p.mods)
    scalars += dropout.arguments(p)
    queries, keys = kernels
    inputs = tuple(bits(a) for a in (p.q, p.k, p.v, p.do))
    grad = (lambda a: a) if qc.GRAD32 else bits   # float32 gradients are written as floats
    slices = (qc.CHUNKS,) if qc.CHUNKS else ()   # the gradients' column slices
    with compile_errors(p.mods, NAME):
        queries(query_grid + slices, (qc.NT,), smem[0],
                inputs + (bits(p.o), lse, delta, grad(p.dq)) + scalars, device)
        keys(key_grid + slices, (kc.NT,), smem[1],
             inputs + (lse, delta, grad(p.dk), grad(p.dv)) + scalars + bias_args +
             arg_args + ((dq_acc,) if kc.DQADD else ()), device)
    if kc.DQADD:   # rounded to the gradient's dtype as the query pass's stores round
        dq_round.run(dq_acc, grad(p.dq), "float32" if qc.GRAD32 else p.dtype_name, device)
    if bias_args and acc.data.ptr != p.dbias.data.ptr:
        p.dbias[...] = acc.reshape(p.dbias.shape)
    if arg_args:
        if int(arg_args[-1][0]):   # (the one copy to the host mod_args' gradients cost)
            bad = [n for n, _ in p.mods.arg_grads]
            raise IndexError(f"score_mod_args_grad{bad} gave an index outside its mod_args "
                             f"array (an int for a 1-D array, else a tuple of its ndim ints, "
                             f"each in [0, size)); nothing was added there")
        for g, a in zip((g for g in p.dmod_args if g is not None), arg_accs):
            g[...] = a


def packed_note(problem):
    """explain's line about a packed backward (VARLEN: both passes in one launch each; cuda.wgmma's
    key pass too)."""
    packed = problem.varlen
    return packed.note(problem.causal, f"blocks for the longest sequence's {packed.max_q} query "
                                       f"rows and {packed.max_k} keys", passes=True)


def notes(problem, cfg, device):
    """What explain adds about a backward config: float32 gradients, packed sequences, the column
    slices of a wide head dim."""
    lines = []
    if cfg["keys"].DQADD:
        lines.append("dQ: the key pass adds dS K into a float32 accumulator (red.global.add.v4.f32"
                     ", sm_90) and the query pass computes delta only: 5 products, not 7; the "
                     "adds' order varies from run to run (deterministic=True takes the two "
                     "passes, dQ in the query pass)")
    if cfg["keys"].DBIAS:
        mode = cfg["keys"].DBIAS
        acc = bias_accumulator_type(mode, cfg["keys"].DT)
        lines.append("attn_bias gradient: " + {
            "store": f"the key pass writes each pair's dS into a {acc} array of the bias's shape",
            "rows": "the key pass sums each key's column of dS over the queries in registers, "
                    "then adds it atomically (float64), once a head and block",
        }.get(mode, f"the key pass adds each pair's dS into a {acc} accumulator of the bias's "
                    f"shape by atomic adds") + (
            "" if mode == "store" else " (a broadcast bias's sums, in an order that varies "
                                       "from run to run)"))
    if cfg["keys"].MARGS:
        lines.append("mod_args gradients: the key pass adds each pair's dS times "
                     "score_mod_args_grad's derivative into float64 accumulators by atomic "
                     "adds (in an order that varies from run to run)")
    if cfg["queries"].GRAD32:
        lines.append("grad_dtype float32: dQ, dK and dV stored as accumulated in float32, not "
                     "rounded to the inputs' 16 bits")
    if cfg["queries"].VARLEN:
        lines.append(packed_note(problem))
    n = cfg["queries"].CHUNKS
    if not n:
        return lines
    return lines + [f"d={problem.shape[4]}, dv={problem.shape[5]}: each pass splits the gradients' "
            f"columns into {n} slices over the grid, each block recomputing S and dP for its "
            f"slice (a block holds at most {COLUMNS_PER_BLOCK[cfg['queries'].DT]} columns of "
            "each gradient in registers)"]
