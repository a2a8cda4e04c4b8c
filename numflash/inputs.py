"""Argument checks: turn a user's call into one normalized :class:`Problem` that every kernel takes.

Kernels never see layouts or option spellings: q, k, v and the output are always 4-D
(B, H, N, d) views read through their strides (``layout="bshd"`` is a zero-copy transpose), and the
causal mode is reduced to one integer offset (query i sees keys j <= i + causal_offset).
"""
import contextlib
from dataclasses import dataclass
import math
import numbers

import numpy as np

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
# dtype.name costs microseconds a call: hot paths compare dtype objects and look names up here.
_NUMPY_FLOATS = {np.dtype(n): n for n in ("float16", "float32", "float64")}


def dtype_name(dt):
    return _NUMPY_FLOATS.get(dt) or np.dtype(dt).name


def lse_dtype(dt):
    """The dtype of the lse for inputs of dtype ``dt``: float64 for float64 inputs (the backward
    recomputes P = exp(S - lse), so a float32 lse would bound float64 gradients near 1e-7),
    float32 otherwise."""
    name = dt if isinstance(dt, str) else np.dtype(dt).name   # "bfloat16" needs no ml_dtypes
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


LAYOUTS = ("bhsd", "bshd")
CAUSAL_MODES = (False, True, "top_left", "bottom_right")
#: "auto": float32-level accuracy in the input dtype (float32 may run on tensor cores as 3xTF32,
#: held to the same accuracy rule as the FMA kernels); "ieee": float32 only on the FMA units
#: (IEEE products and sums); "tf32": float32 inputs on tensor cores with one tf32 mma per product
#: (10-bit mantissa products, fp32 accumulation), an explicit opt-in.
PRECISIONS = ("auto", "ieee", "tf32")
IEEE_REASON = ("precision='ieee' keeps float32 on the FMA units (IEEE float32 products and sums); "
               "cuda.mma computes float32 on tensor cores (3xTF32); the IEEE float32 kernels are "
               "cuda.block (forward) and cuda.row (backward)")


def array_kind(x):
    """'numpy', 'cupy', or 'cuda' (any other object with __cuda_array_interface__); None otherwise."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__"):
        return "cupy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cuda"
    return None


def _as_cupy(x):
    import cupy
    return cupy.asarray(x)  # zero-copy view of any __cuda_array_interface__ object


def host_values(name, a, expected):
    """A list, tuple, NumPy or device array ``a`` as a host NumPy array, for the few integers
    (sequence offsets, cache lengths) the host slices or checks by; a device array is copied.
    Anything else raises TypeError naming ``name`` and what was ``expected``."""
    kind = array_kind(a)
    if kind in ("cupy", "cuda"):
        return _as_cupy(a).get()
    if kind is None and not isinstance(a, (list, tuple)):
        raise TypeError(f"{name} must be {expected}; got {type(a).__name__}")
    return np.asarray(a)


@dataclass
class Problem:
    """One attention call, normalized. Arrays are (B, H, N, d) views of the user's memory."""
    q: object
    k: object
    v: object
    out: object        # (B, H, Nq, dv) view the kernels write, in q's dtype
    result: object     # what attention() returns: the user's `out`, or a new array in their layout
    kind: str          # "numpy" or "cupy" (other device arrays are wrapped as CuPy, zero-copy)
    dtype: np.dtype
    dtype_name: str
    scale: float
    causal: bool
    causal_offset: int  # query row i sees key j iff j <= i + causal_offset (when causal)
    return_lse: bool
    layout: str
    precision: str = "auto"  # one of PRECISIONS; "tf32" only with float32 inputs
    # The backward (direction "backward"): do, o, lse are its extra inputs as (B, H, N, .) views,
    # dq, dk, dv the views it writes (out is None); result is the user's (dq, dk, dv).
    direction: str = "forward"
    do: object = None
    o: object = None
    lse: object = None
    dq: object = None
    dk: object = None
    dv: object = None
    deterministic: bool = False
    grad_dtype: np.dtype = None  # the backward's dq, dk, dv dtype: q's, or float32 for 16-bit q
    mods: object = None  # numflash.mods.Mods: score / mask modifications, or None
    num_splits: int = None  # the forward's forced split-KV share count (None: the kernel picks)
    kvcache: object = None  # numflash.kvcache.KVCache: per-entry key counts and pages, or None
    varlen: object = None   # numflash.varlen.Packed: packed sequences run in one launch, or None
    dropout: object = None  # numflash.dropout.Dropout: p and seed of attention dropout, or None
    dbias: object = None    # the backward's attn_bias gradient (bias's shape and dtype), written
    #                         by kernels that declare bias_grad; None when not asked for
    dmod_args: tuple = None  # the backward's gradients of mod_args (numflash.api's
    #                          _with_mod_args_grad), added into by kernels that declare
    #                          mod_args_grad; None when not asked for

    @property
    def shape(self):
        B, H, Nq, d = self.q.shape
        return B, H, Nq, self.k.shape[2], d, self.v.shape[3]

    @property
    def kv_group(self):
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.q.shape[1] // self.k.shape[1] if self.k.shape[1] else 1

    @property
    def on_device(self):
        return self.kind == "cupy"

    @property
    def xp(self):
        if self.kind == "cupy":
            import cupy
            return cupy
        return np

    def host(self, a):
        return a.get() if self.kind == "cupy" else np.asarray(a)

    def write_out(self, o):
        """Copy a host (B, H, Nq, dv) result into the output view, cast to its dtype."""
        self.out[...] = self.xp.asarray(np.asarray(o).astype(self.out.dtype))

    def empty_lse(self):
        B, H, Nq = self.q.shape[:3]
        return self.xp.empty((B, H, Nq), dtype=lse_dtype(self.dtype))


def parse_causal(causal, nq, nk):
    """Return (is_causal, offset) for the user's ``causal`` argument."""
    if causal is False or causal is None:
        return False, 0
    if causal is True or causal == "top_left":
        return True, 0
    if causal == "bottom_right":
        return True, nk - nq
    raise ValueError(f"causal must be one of False, True, 'top_left', 'bottom_right'; got {causal!r}")


def _check_array(name, x):
    kind = array_kind(x)
    if kind is None:
        raise TypeError(f"{name} must be a NumPy array, a CuPy array or an object with "
                        f"__cuda_array_interface__; got {type(x).__name__}")
    dt = np.dtype(x.dtype) if kind != "cuda" else None
    if dt is not None and dt not in _NUMPY_FLOATS and dt.name not in SUPPORTED_DTYPES:
        what = "an integer" if dt.kind in "iub" else "an unsupported"
        raise TypeError(f"{name} has {what} dtype {dt}; numflash supports "
                        f"{', '.join(SUPPORTED_DTYPES)}")
    if dt is not None and not dt.isnative:
        raise TypeError(f"{name} has non-native byte order dtype {dt.str}; convert it with "
                        f"{name}.astype({name}.dtype.newbyteorder('='))")
    return kind


def _dims(layout, a):
    """(B, H, N, d) view of a 4-D array in the given layout."""
    return a if layout == "bhsd" else a.transpose(0, 2, 1, 3)


def check_precision(precision, dtype=None):
    """Validate ``precision``; with a dtype, also that tf32 was asked for float32 inputs."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} ('tf32': float32 inputs on "
                         f"tensor cores); got {precision!r}")
    if precision == "tf32" and dtype is not None and dtype_name(dtype) != "float32":
        raise ValueError(f"precision='tf32' applies to float32 inputs only; got "
                         f"{dtype_name(dtype)} (leave precision='auto')")
    return precision


def softmax_scale_value(softmax_scale, d):
    """The scale as a float: 1/sqrt(d) for None, else a finite real number > 0 (checked)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0  # d = 0 is refused by the shape checks
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got "
                        f"{type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int too large for a float
        scale = math.inf
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale!r}")
    return scale


def _check_qkv(q, k, v, causal, softmax_scale, layout, precision):
    """The checks the forward and the backward share. Returns (kind, dtype, (q4, k4, v4), scale,
    is_causal, causal_offset) with q4, k4, v4 the (B, H, N, d) views of the (CuPy) arrays."""
    check_precision(precision)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (B, H, N, d) or 'bshd' (B, N, H, d); got {layout!r}")
    kinds = {name: _check_array(name, a) for name, a in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n} is {kd}" for n, kd in kinds.items())
        raise TypeError(f"q, k and v must all live on the same side (all NumPy or all device "
                        f"arrays); got {desc}")
    kind = kinds["q"]
    if kind == "cuda":
        q, k, v = _as_cupy(q), _as_cupy(k), _as_cupy(v)
        kind = "cupy"
        for name, a in (("q", q), ("k", k), ("v", v)):
            _check_array(name, a)
    if kind == "cupy":
        devices = {name: a.device.id for name, a in (("q", q), ("k", k), ("v", v))}
        if len(set(devices.values())) > 1:
            raise ValueError(f"q, k and v must be on one GPU; got devices {devices}")

    order = "(B, H, N, d)" if layout == "bhsd" else "(B, N, H, d)"
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D {order} for layout={layout!r}; got shape "
                             f"{tuple(a.shape)}")
    dtypes = {name: np.dtype(a.dtype) for name, a in (("q", q), ("k", k), ("v", v))}
    if len(set(dtypes.values())) > 1:
        raise TypeError("q, k and v must share one dtype; got "
                        + ", ".join(f"{n}={dt}" for n, dt in dtypes.items()))
    dtype = dtypes["q"]
    check_precision(precision, dtype)

    q4, k4, v4 = _dims(layout, q), _dims(layout, k), _dims(layout, v)
    (B, H, Nq, d), (Bk, Hk, Nk, dk), (Bv, Hv, Nv, dv) = q4.shape, k4.shape, v4.shape
    if Bk != B or Bv != B:
        raise ValueError(f"q, k and v must have the same batch size B: q has {B}, k has {Bk}, "
                         f"v has {Bv}")
    if Hv != Hk:
        raise ValueError(f"k and v must have the same number of heads; got k {Hk}, v {Hv}")
    if (Hk == 0 and H != 0) or (Hk and H % Hk):
        raise ValueError(f"q's heads must be a multiple of k's and v's (grouped-query attention: "
                         f"query head h reads key/value head h // (H // Hk)); got q {H} heads, "
                         f"k and v {Hk}")
    if Nv != Nk:
        raise ValueError(f"k and v must have the same sequence length; got k N={Nk}, v N={Nv}")
    if dk != d:
        raise ValueError(f"q and k must have the same head dim d; got q d={d}, k d={dk}")
    if d == 0:
        raise ValueError("head dim d of q and k is 0; attention needs d >= 1")
    if dv == 0:
        raise ValueError("head dim of v is 0; attention needs dv >= 1")

    scale = softmax_scale_value(softmax_scale, d)

    if not (isinstance(causal, (bool, str)) or causal is None) or (
            isinstance(causal, str) and causal not in CAUSAL_MODES):
        raise ValueError(f"causal must be one of False, True, 'top_left', 'bottom_right'; got "
                         f"{causal!r}")
    is_causal, offset = parse_causal(causal, Nq, Nk)

    return kind, dtype, (q4, k4, v4), scale, is_causal, offset


def _check_output(name, a, kind, dtype, device_id, shape, layout, inputs, what="q's"):
    """A user-supplied output array: its kind, device, shape, dtype, writability, and no overlap
    with the arrays the kernel reads while writing it. Returns it (CuPy-wrapped if need be)."""
    a_kind = array_kind(a)
    if a_kind == "cuda" and kind == "cupy":
        a, a_kind = _as_cupy(a), "cupy"
    if a_kind != kind:
        raise TypeError(f"{name} must be the same kind of array as q ({kind}); got "
                        f"{a_kind or type(a).__name__}")
    if kind == "cupy" and a.device.id != device_id:
        raise ValueError(f"{name} is on device {a.device.id} but q is on device {device_id}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} for layout={layout!r}; got "
                         f"{tuple(a.shape)}")
    if np.dtype(a.dtype) != dtype:
        raise TypeError(f"{name} must have {what} dtype {dtype}; got {a.dtype}")
    if a.size and any(st == 0 and n > 1 for st, n in zip(a.strides, a.shape)):  # empty: no overlap
        raise ValueError(f"{name} has a zero stride (a broadcast view): its elements overlap")
    if kind == "numpy" and not a.flags.writeable:
        raise ValueError(f"{name} is read-only")
    xp = np if kind == "numpy" else _cupy()
    for other, b in inputs:
        if xp.may_share_memory(a, b):  # kernels read inputs while writing outputs
            raise ValueError(f"{name} overlaps {other}: pass a separate output array")
    return a


def _cupy():
    import cupy
    return cupy


def _on_device(kind, device_id):
    """Where new arrays for CuPy inputs go: the inputs' GPU, not the current one."""
    return _cupy().cuda.Device(device_id) if kind == "cupy" else contextlib.nullcontext()


def _user_shape(layout, B, H, N, d):
    return (B, H, N, d) if layout == "bhsd" else (B, N, H, d)


def check_num_splits(num_splits):
    """num_splits as given: None, or an int from 1 to MAX_NUM_SPLITS (a grid dimension)."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be None or an int; got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be between 1 and {MAX_NUM_SPLITS}; got {num_splits}")
    return int(num_splits)


#: the most shares num_splits may ask for (the CUDA grid's z dimension)
MAX_NUM_SPLITS = 65535


def normalize(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", return_lse=False,
              out=None, precision="auto", num_splits=None):
    """The forward's :class:`Problem` for an ``attention`` call (raises on bad arguments)."""
    num_splits = check_num_splits(num_splits)
    kind, dtype, (q4, k4, v4), scale, is_causal, offset = _check_qkv(
        q, k, v, causal, softmax_scale, layout, precision)
    B, H, Nq, _ = q4.shape
    user_shape = _user_shape(layout, B, H, Nq, v4.shape[3])
    if out is None:
        result = (np if kind == "numpy" else _cupy()).empty(user_shape, dtype=dtype)
    else:
        result = _check_output("out", out, kind, dtype, _device_id(q4, kind), user_shape, layout,
                               (("q", q4), ("k", k4), ("v", v4)))
    return Problem(q=q4, k=k4, v=v4, out=_dims(layout, result), result=result, kind=kind,
                   dtype=dtype, dtype_name=dtype_name(dtype), scale=scale, causal=is_causal,
                   causal_offset=offset,
                   return_lse=bool(return_lse), layout=layout, precision=precision,
                   num_splits=num_splits)


def _device_id(a, kind):
    return a.device.id if kind == "cupy" else None


def check_grad_dtype(grad_dtype, dtype):
    """The gradients' dtype for inputs of ``dtype`` (a dtype, or its name): q's for None;
    float32 is also taken for float16 / bfloat16 inputs (the kernels' accumulators, not rounded
    to 16 bits: for callers that sum partial gradients). A torch dtype is taken by name.
    Returns ``dtype`` as given, or numpy's float32."""
    if grad_dtype is None:
        return dtype
    try:
        if type(grad_dtype).__module__ == "torch":
            wanted = str(grad_dtype).replace("torch.", "")
        elif isinstance(grad_dtype, str) and grad_dtype == "bfloat16":  # without ml_dtypes
            wanted = grad_dtype
        else:
            wanted = dtype_name(np.dtype(grad_dtype))
    except TypeError:
        raise TypeError(f"grad_dtype must be None or a dtype; got {grad_dtype!r}") from None
    have = dtype if isinstance(dtype, str) else dtype_name(dtype)
    if wanted == have:
        return dtype
    if wanted == "float32" and have in ("float16", "bfloat16"):
        return np.dtype(np.float32)
    raise TypeError(f"grad_dtype={wanted} with {have} inputs: the gradients come in q's dtype "
                    f"({have}), or in float32 for float16 / bfloat16 inputs")


def normalize_backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, layout="bhsd",
                       precision="auto", deterministic=False, dq=None, dk=None, dv=None,
                       grad_dtype=None):
    """The backward's :class:`Problem` for an ``attention_backward`` call.

    do and o have the output's shape in ``layout`` and q's dtype and kind; lse is (B, H, Nq) in
    :func:`lse_dtype` (what ``attention(..., return_lse=True)`` returned). dq, dk, dv, when given,
    receive the gradients (shapes of q, k, v, dtype ``grad_dtype``: see
    :func:`check_grad_dtype`); otherwise new arrays are made.
    """
    kind, dtype, (q4, k4, v4), scale, is_causal, offset = _check_qkv(
        q, k, v, causal, softmax_scale, layout, precision)
    B, H, Nq, d = q4.shape
    dv_ = v4.shape[3]
    dev = _device_id(q4, kind)
    extra = {}
    for name, a in (("do", do), ("o", o), ("lse", lse)):
        a_kind = _check_array(name, a)
        if a_kind == "cuda" and kind == "cupy":
            a, a_kind = _as_cupy(a), "cupy"
        if a_kind != kind:
            raise TypeError(f"{name} must be the same kind of array as q ({kind}); got {a_kind}")
        if kind == "cupy" and a.device.id != dev:
            raise ValueError(f"{name} is on device {a.device.id} but q is on device {dev}")
        extra[name] = a
    out_shape = _user_shape(layout, B, H, Nq, dv_)
    for name in ("do", "o"):
        a = extra[name]
        if tuple(a.shape) != out_shape:
            raise ValueError(f"{name} must have the output's shape {out_shape} for "
                             f"layout={layout!r}; got {tuple(a.shape)}")
        if np.dtype(a.dtype) != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}; got {a.dtype}")
    lse_ = extra["lse"]
    if tuple(lse_.shape) != (B, H, Nq):
        raise ValueError(f"lse must have shape (B, H, Nq) = {(B, H, Nq)} (what attention(..., "
                         f"return_lse=True) returns); got {tuple(lse_.shape)}")
    if np.dtype(lse_.dtype) != lse_dtype(dtype):
        raise TypeError(f"lse must be {lse_dtype(dtype)} for {dtype} inputs (what attention(..., "
                        f"return_lse=True) returns); got {lse_.dtype}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")

    grad_dt = check_grad_dtype(grad_dtype, dtype)
    inputs = (("q", q4), ("k", k4), ("v", v4), ("do", extra["do"]), ("o", extra["o"]),
              ("lse", lse_))
    xp = np if kind == "numpy" else _cupy()
    grads = []
    for name, given, src in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None:
            with _on_device(kind, dev):
                grads.append(xp.empty(src.shape, dtype=grad_dt))
            continue
        given = _check_output(name, given, kind, grad_dt, dev, tuple(src.shape), layout,
                              inputs + tuple((n, g) for n, g in zip(("dq", "dk"), grads)),
                              what="grad_dtype's" if grad_dtype is not None else "q's")
        grads.append(given)
    return Problem(q=q4, k=k4, v=v4, out=None, result=tuple(grads), kind=kind, dtype=dtype,
                   dtype_name=dtype_name(dtype), scale=scale, causal=is_causal,
                   causal_offset=offset, return_lse=False, layout=layout, precision=precision,
                   direction="backward", do=_dims(layout, extra["do"]), o=_dims(layout, extra["o"]),
                   lse=lse_, dq=_dims(layout, grads[0]), dk=_dims(layout, grads[1]),
                   dv=_dims(layout, grads[2]), deterministic=bool(deterministic),
                   grad_dtype=grad_dt)
