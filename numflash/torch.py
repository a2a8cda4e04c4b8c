"""PyTorch entry points: numflash as a torch operator, differentiable and zero-copy.

The layers, innermost first (as flash-attn stacks extension -> custom op -> autograd -> API):

- :func:`numflash.attention` / :func:`numflash.attention_backward` on NumPy / CuPy views of the
  tensors' memory (``Tensor.numpy()`` on the CPU, DLPack on the GPU: no copy either way);
- two torch operators, ``numflash::attention`` and ``numflash::attention_backward``
  (``torch.library.custom_op``), with fake implementations so that ``torch.compile`` traces them
  without a graph break, and CUDA launches on torch's current stream;
- ``register_autograd`` ties them together, so gradients flow through ``loss.backward()`` and
  ``torch.autograd.grad``; ``register_vmap`` folds a vmapped dimension into the batch. Eager
  calls skip the operator's dispatch: without autograd they run the body directly, with it an
  autograd.Function holding the same pieces (see :func:`_run_forward`). ``torch.func.grad``
  cannot run them (its backward tensors have no memory to read) and raises saying so;
- public functions with the signatures people already call: :func:`scaled_dot_product_attention`
  (torch's) and :func:`flash_attn_func` (flash-attn's), plus :func:`attention`, which
  :func:`numflash.attention` hands torch tensors to.

Repeated CUDA calls replay the recorded kernel launch with the tensors' data pointers (as
numflash.cuda.fastpath does for CuPy), so a call costs two torch allocations (out, lse) and one
launch; a repeated backward replays its launches too (fastpath.GradientReplay: the gradients
and scratch from torch's allocator).
"""
import threading

import torch

from . import api as _api
from .cuda import fastpath as _fastpath
from .inputs import check_grad_dtype, softmax_scale_value
from .varlen import merge_partials as _api_merge_partials

__all__ = ["attention", "attention_backward", "scaled_dot_product_attention", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "attention_probabilities",
           "merge_partials", "install_as_sdpa"]

_CAUSAL = {False: "none", None: "none", True: "top_left", "top_left": "top_left",
           "bottom_right": "bottom_right"}
_CAUSAL_ARG = {"none": False, "top_left": "top_left", "bottom_right": "bottom_right"}
_LAYOUT_DIMS = {"bhsd": (0, 1, 2), "bshd": (0, 2, 1)}  # positions of B, H, N in each layout


def _causal_name(causal):
    try:
        return _CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal must be one of False, True, 'top_left', 'bottom_right'; got "
                         f"{causal!r}") from None


_scale = softmax_scale_value  # one rule for every entry point (numflash.inputs)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_tensors(**tensors):
    """What must hold before any tensor is viewed as an array: tensors, one device, a dtype and a
    device numflash runs. The shapes and the rest are numflash's own checks."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("tensors must be on one device; got "
                         + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    name, t = next(iter(tensors.items()))
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"numflash runs CPU and CUDA tensors; {name} is on {t.device}")
    if t.device.type == "cpu" and t.dtype == torch.bfloat16:
        raise TypeError(f"{name} is a bfloat16 CPU tensor: numflash's CPU path (cpu.tiled) takes "
                        f"float16, float32 and float64; bfloat16 runs on CUDA tensors")


_FUNC_GRAD_REASON = (
    "numflash's attention cannot be differentiated by torch.func.grad / vjp / jacrev (torch "
    "hands its backward tensors without memory to read); use torch.autograd.grad or "
    "loss.backward(). torch.func.vmap works")


def _views(*tensors):
    """Zero-copy NumPy (CPU) or CuPy (CUDA) views of the tensors' memory, strides kept."""
    if any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors)):
        raise NotImplementedError(_FUNC_GRAD_REASON)
    if tensors[0].device.type == "cpu":
        return [t.detach().numpy() for t in tensors]
    import cupy
    return [cupy.from_dlpack(t.detach()) for t in tensors]


def _tensor(array, like):
    """A NumPy (CPU) or CuPy (CUDA) result as a torch tensor on ``like``'s device, no copy."""
    return torch.from_numpy(array) if like.device.type == "cpu" else torch.from_dlpack(array)


def _current_device():
    """torch.cuda.current_device() without its lazy-initialization check (CUDA is initialized
    once a CUDA tensor exists)."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return get() if get is not None else torch.cuda.current_device()


def _current_stream(index):
    """torch's current CUDA stream on device ``index`` as a raw handle. The private call is what
    Triton uses; it skips building a torch.cuda.Stream object (microseconds a call)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol (``__cuda_stream__``: (version, handle))."""
    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


def _external_stream(cupy, handle, device_id):
    """A CuPy stream object for torch's stream ``handle``: Stream.from_external where CuPy has
    it (CuPy 14 deprecates ExternalStream), ExternalStream before."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device_id)


class _on_torch_stream:
    """Inside: CuPy's current device and stream are the tensor's device and torch's current
    stream there, so numflash's launches are ordered with the model's other work (no sync)."""

    def __init__(self, t):
        self.t = t

    def __enter__(self):
        if self.t.device.type != "cuda":
            return None
        import cupy
        self.device = cupy.cuda.Device(self.t.device.index)
        self.device.__enter__()
        handle = _current_stream(self.t.device.index)
        self.stream = _external_stream(cupy, handle, self.t.device.index)
        self.stream.__enter__()
        return handle

    def __exit__(self, *exc):
        if self.t.device.type == "cuda":
            self.stream.__exit__(*exc)
            self.device.__exit__(*exc)


def _out_shape(q, v, layout):
    shape = list(q.shape)
    shape[3] = v.shape[3]
    return tuple(shape)


def _lse_shape(q, layout):
    b, h, n = _LAYOUT_DIMS[layout]
    return (q.shape[b], q.shape[h], q.shape[n])


# ---- CUDA replays: a repeated call launches the recorded kernel on the tensors' pointers ----

_replays = {}
_MAX_REPLAYS = 1024
_replay_lock = threading.Lock()


class _Replay:
    """The outputs are made the cheapest way torch has (H200 host, bench/NOTES.md "The
    forward's host time"): empty_like(q) 3.9 us where q's shape and layout are the output's
    (a contiguous q, dv = d: the key holds q's strides), q.new_empty 5.3 us, against 6.5 us for
    torch.empty(shape, dtype=, device=)."""
    __slots__ = ("recipe", "out_shape", "out_like_q", "lse_shape", "lse_dtype")

    def __init__(self, recipe, q, out_shape, lse_shape):
        self.recipe, self.out_shape, self.lse_shape = recipe, out_shape, lse_shape
        self.out_like_q = out_shape == tuple(q.shape) and q.is_contiguous()
        self.lse_dtype = _lse_dtype(q.dtype)

    def __call__(self, q, k, v):
        out = torch.empty_like(q) if self.out_like_q else q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        self.recipe.launch(_current_stream(q.device.index), (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()))
        return out, lse


def _replay_key(q, k, v, options):
    """None unless q, k, v are plain tensors and q is on the current device (a replay launches
    in the current context)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or \
            type(v) is not torch.Tensor:   # (a subclass's replay would return its own type)
        return None
    if q.device.index != _current_device():
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16,
            v.data_ptr() % 16, options)


def _gradient_replay_key(tensors, options):
    """A backward's replay key: None unless the six tensors are plain tensors and q is on the
    current device."""
    if any(type(t) is not torch.Tensor for t in tensors):
        return None
    if tensors[1].device.index != _current_device():
        return None
    return ("backward",) + tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                                 for t in tensors) + (options,)


def _torch_bytes(device):
    def allocate(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t, t.data_ptr()
    return allocate


def _replay_gradients(replay, tensors):
    """(dq, dk, dv) as new tensors from a fastpath.GradientReplay, on torch's current stream
    (scratch from torch's allocator, ordered on that stream)."""
    device = tensors[1].device
    grads = tuple(t.new_empty(t.shape) for t in tensors[1:4])   # contiguous, as recorded
    replay.launch(_current_stream(device.index), [t.data_ptr() for t in tensors + grads],
                  _torch_bytes(device))
    return grads


def _keep_replay(key, replay):
    with _replay_lock:
        if len(_replays) >= _MAX_REPLAYS:
            _replays.clear()
        _replays[key] = replay


def _remember_gradients(key, launches, tensors, grads):
    replay = _fastpath.gradient_replay(launches, [t.data_ptr() for t in (*tensors, *grads)],
                                       grads)
    if replay is not None:
        _keep_replay(key, replay)


def _forward_impl(q, k, v, causal, scale, layout, backend, algorithm, precision):
    """(out, lse) as new tensors on q's device: the operator's body."""
    on_cuda = q.is_cuda
    key = None
    if on_cuda:  # a recorded call's key holds everything the checks below depend on
        key = _replay_key(q, k, v, (causal, scale, layout, backend, algorithm, precision))
        replay = _replays.get(key)
        if replay is not None:  # the key holds the current device: it is q's
            return replay(q, k, v)
    _check_tensors(q=q, k=k, v=v)
    out = torch.empty(_out_shape(q, v, layout), dtype=q.dtype, device=q.device)
    lse, launches = _forward_into(out, q, k, v, causal, scale, layout, backend, algorithm,
                                  precision)
    recipe = None if key is None else _fastpath.replayable(
        launches, [t.data_ptr() for t in (q, k, v, out, lse)])
    if recipe is not None:
        _keep_replay(key, _Replay(recipe, q, tuple(out.shape), tuple(lse.shape)))
    return out, lse


def _forward_into(out, q, k, v, causal, scale, layout, backend, algorithm, precision, mods=None):
    """numflash.attention on views of the tensors, writing ``out``: (the lse as a tensor, the
    launches it made). ``mods``: modification options (numflash.mods), tensors among them."""
    with _on_torch_stream(q):
        qa, ka, va, outa = _views(q, k, v, out)
        with _fastpath.recording() as launches:
            _, lse = _api.attention(qa, ka, va, causal=_CAUSAL_ARG[causal], softmax_scale=scale,
                                    layout=layout, backend=backend, algorithm=algorithm,
                                    return_lse=True, out=outa, precision=precision,
                                    **_mod_arrays(mods))
    return _tensor(lse, q), launches


def _backward_impl(do, q, k, v, o, lse, causal, scale, layout, backend, algorithm, precision,
                   deterministic, grads=None, mods=None, grad_dtype=None, bias_grad=False,
                   mod_args_grad=False):
    """(dq, dk, dv): into ``grads`` when given (checked by numflash), else new tensors; with
    ``bias_grad``, attn_bias's gradient (a new tensor) next; with ``mod_args_grad``, last, the
    tuple of mod_args' gradients (new tensors; None where an argument takes none). A
    repeated CUDA call without any of those replays its recorded launches
    (numflash.cuda.fastpath.GradientReplay)."""
    tensors = (do, q, k, v, o, lse)
    key = None
    if grads is None and not mods and grad_dtype is None and not bias_grad and \
            not mod_args_grad and q.is_cuda:
        key = _gradient_replay_key(tensors, (causal, scale, layout, backend, algorithm,
                                             precision, deterministic))
        replay = _replays.get(key)
        if replay is not None:  # the key holds the current device: it is q's
            return _replay_gradients(replay, tensors)
    _check_tensors(do=do, q=q, k=k, v=v, o=o, lse=lse)
    if grads is None:
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    with _on_torch_stream(q), _fastpath.recording() as launches:
        arrays = _views(do, q, k, v, o, lse, *grads)
        result = _api.attention_backward(
            *arrays[:6], causal=_CAUSAL_ARG[causal], softmax_scale=scale, layout=layout,
            backend=backend, algorithm=algorithm, precision=precision,
            deterministic=deterministic, dq=arrays[6], dk=arrays[7], dv=arrays[8],
            grad_dtype=grad_dtype, return_bias_grad=bias_grad,
            return_mod_args_grad=mod_args_grad, **_mod_arrays(mods))
    if key is not None:
        _remember_gradients(key, launches, tensors, grads)
    extra = ((_tensor(result[3], q),) if bias_grad else ()) + (
        (tuple(None if g is None else _tensor(g, q) for g in result[-1]),) if mod_args_grad
        else ())
    return tuple(grads) + extra


# ---- score and mask modifications (numflash.mods) ----

_MOD_TENSORS = ("alibi_slopes", "attn_bias", "attn_mask")


def _mod_arrays(mods):
    """The modification options with their tensors as NumPy / CuPy views (no copy). A tensor
    that requires grad is refused (numflash computes no gradient for it, and leaving it out
    silently would train a tensor that never moves), except attn_bias and the mod_args that
    score_mod_args_grad differentiates, which :func:`attention` passes to autograd as inputs
    (_trainable)."""
    if not mods:
        return {}
    out = dict(mods)
    for name in _MOD_TENSORS:
        if isinstance(out.get(name), torch.Tensor):
            out[name] = _mod_tensor(name, out[name])
    if out.get("mod_args"):
        out["mod_args"] = tuple(_mod_tensor(f"mod_args[{i}]", a) if isinstance(a, torch.Tensor)
                                else a for i, a in enumerate(out["mod_args"]))
    return out


def _dropout_options(dropout_p, dropout_seed):
    """{dropout_p, dropout_seed} of a call ({} without dropout), the seed drawn from torch's
    default generator when none is given (torch.manual_seed makes it reproducible)."""
    if not dropout_p:
        return {}
    if dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2 ** 63 - 1, ()).item())
    return {"dropout_p": dropout_p, "dropout_seed": dropout_seed}


def _mod_tensor(name, t):
    if t.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"{name} requires grad, but numflash computes gradients for q, "
                                  f"k, v, attn_bias and the mod_args that score_mod_args_grad "
                                  f"differentiates only: detach it, give score_mod_args_grad "
                                  f"its derivative (numflash.mods), or express it as an "
                                  f"attn_bias")
    return _views(t)[0]


def _requires_grad(t):
    return isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()


def _trainable(mods):
    """(attn_bias when it requires grad, else None; {n: mod_args[n]} for the tensors that
    require grad and that score_mod_args_grad differentiates; the options with those detached:
    views of the same memory, read in place). The trainable ones become autograd's inputs."""
    bias = mods.get("attn_bias")
    bias = bias if _requires_grad(bias) else None
    if bias is not None:
        mods = dict(mods, attn_bias=bias.detach())
    derivatives = mods.get("score_mod_args_grad") or ()
    args = mods.get("mod_args") or ()
    trained = [n for n, a in enumerate(args)
               if _requires_grad(a) and n < len(derivatives) and derivatives[n] is not None]
    if trained:
        mods = dict(mods, mod_args=tuple(a.detach() if n in trained else a
                                         for n, a in enumerate(args)))
    return bias, {n: args[n] for n in trained}, mods


class _ModsFunction(torch.autograd.Function):
    """Attention with modifications on torch tensors, differentiable in q, k and v (and in
    ``bias``, a trainable attn_bias, when given): the same forward and backward bodies as the
    operators, with the modification options passed through. Eager only for now (not a torch
    operator: torch.compile breaks the graph here)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale, layout, backend, algorithm, precision,
                deterministic, mods, trained_at, *trained_args):
        _check_tensors(q=q, k=k, v=v)
        out = torch.empty(_out_shape(q, v, layout), dtype=q.dtype, device=q.device)
        lse, _ = _forward_into(out, q, k, v, causal, scale, layout, backend, algorithm,
                               precision, mods)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, scale, layout, backend, "auto", precision, deterministic)
        ctx.mods = mods
        ctx.trained_at = trained_at  # which mod_args trained_args are (mods holds them detached)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        bias_grad = ctx.needs_input_grad[3]
        arg_grads = any(ctx.needs_input_grad[13:])
        grads = _gradients(lambda *a: _backward_impl(*a, mods=ctx.mods, bias_grad=bias_grad,
                                                     mod_args_grad=arg_grads), ctx, d_out)
        trained = (None,) * len(ctx.trained_at)
        if arg_grads:  # numflash's tuple is aligned with mod_args
            trained = tuple(grads[3 + bias_grad][n] for n in ctx.trained_at)
        return grads[:3] + (grads[3] if bias_grad else None,) + (None,) * 9 + trained


# ---- the operators ----

@torch.library.custom_op("numflash::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str, scale: float,
                  layout: str, backend: str, algorithm: str, precision: str,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` is the backward's option, carried here so that autograd can pass it on.
    return _forward_impl(q, k, v, causal, scale, layout, backend, algorithm, precision)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, scale, layout, backend, algorithm, precision, deterministic):
    out = q.new_empty(_out_shape(q, v, layout))
    lse = q.new_empty(_lse_shape(q, layout), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("numflash::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, causal: str, scale: float,
                           layout: str, backend: str, algorithm: str, precision: str,
                           deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(do, q, k, v, o, lse, causal, scale, layout, backend, algorithm,
                          precision, deterministic)


@_attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, causal, scale, layout, backend, algorithm,
                             precision, deterministic):
    # contiguous, as the real implementation makes them
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, layout, backend, algorithm, precision, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # The forward's `algorithm` names a forward kernel; the backward chooses its own.
    ctx.options = (causal, scale, layout, backend, "auto", precision, deterministic)
    ctx.mark_non_differentiable(lse)


def _refuse_what_the_backward_cannot_do():
    """Every backward of numflash's autograd Functions checks this first."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(_FUNC_GRAD_REASON)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: the gradients would be constants, and a loss built on them would
        # silently lose their dependence on q, k and v
        raise NotImplementedError("numflash's attention backward is not differentiable: "
                                  "double backward (create_graph=True) is not supported")


def _gradients(backward, ctx, d_out, options=7):
    """(dq, dk, dv) and a None for each of the forward's ``options`` inputs."""
    _refuse_what_the_backward_cannot_do()
    q, k, v, out, lse = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(out)
    grads = backward(d_out, q, k, v, out, lse, *ctx.options)
    return tuple(grads) + (None,) * options


def _op_backward(ctx, d_out, d_lse):
    return _gradients(_attention_backward_op, ctx, d_out)


_attention_op.register_autograd(_op_backward, setup_context=_setup_context)


def _vmap_rule(apply):
    """torch.func.vmap: the mapped dimension becomes part of the batch (B' = V * B)."""
    def rule(info, in_dims, q, k, v, *options):
        size = info.batch_size
        tensors = []
        for t, dim in zip((q, k, v), in_dims[:3]):
            t = t.unsqueeze(0).expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
            tensors.append(t.reshape(size * t.shape[1], *t.shape[2:]))
        out, lse = apply(*tensors, *options)
        return ((out.reshape(size, -1, *out.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])),
                (0, 0))
    return rule


_attention_op.register_vmap(_vmap_rule(_attention_op))


class _AttentionFunction(torch.autograd.Function):
    """The operator's forward and backward without the operator's dispatch, for eager calls that
    record a graph. Old-style (ctx first, no setup_context): with a setup_context, torch binds
    the forward's signature with inspect on every call. Measured on this project's 2-core CPU
    with a stand-in forward: 11 us a call, against 44 us for the setup_context form and 55 us
    for the custom operator's own autograd. The options travel as one tuple: torch's apply
    handles each argument (5.5 us a call against 6.5 us with them one by one, same CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = _forward_impl(q, k, v, *options[:-1])
        _setup_context(ctx, (q, k, v, *options), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return _gradients(_backward_impl, ctx, d_out, options=1)


def _bind_apply(function):
    """``function.apply`` without torch's Python layer around it (autograd.Function.apply), for
    a caller that has checked that no torch.func transform is active: that layer then only
    unwraps tensors a finished transform left behind, which the returned call does itself.
    4.5 us a call against 5.5 us (this project's CPU, stand-in forward). torch's own apply where
    this torch lacks the private pieces."""
    apply_c = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
    unwrap = getattr(torch._C._functorch, "unwrap_if_dead", None)
    if apply_c is None or unwrap is None:
        return function.apply
    bound = apply_c.__get__(None, function)

    def apply(q, k, v, options):
        return bound(unwrap(q), unwrap(k), unwrap(v), options)
    return apply


_attention_function_apply = _bind_apply(_AttentionFunction)


def _run_forward(q, k, v, *options):
    """The cheapest route for how the forward is called: traced (torch.compile) or under a
    torch.func transform, the operator; recording a graph, _AttentionFunction; else the body."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, *options)
    if torch._C._are_functorch_transforms_active():
        try:
            return _attention_op(q, k, v, *options)
        except RuntimeError as e:  # torch.func.grad & co. over a custom_op's autograd
            if "functorch transforms" in str(e):
                raise NotImplementedError(_FUNC_GRAD_REASON) from e
            raise
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _attention_function_apply(q, k, v, options)
    return _forward_impl(q, k, v, *options[:-1])


# ---- public functions ----

def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", backend="auto",
              algorithm="auto", return_lse=False, out=None, precision="auto",
              deterministic=False, dropout_p=0.0, dropout_seed=None, **mods):
    """:func:`numflash.attention` for torch tensors (it is what that function runs for them).

    Differentiable: gradients come from numflash's backward (``deterministic=True`` asks the
    backward for bit-reproducible gradients; by default cuda.wgmma and cuda.mma add dQ
    atomically for 16-bit inputs on sm_90, as FlashAttention-2 and -3 do). The lse is
    not differentiable. ``out=`` writes the result into a tensor and is not differentiable: with
    grad mode on and an input that requires grad, it raises.

    ``mods``: numflash's modification options (window_size, softcap, alibi_slopes, attn_bias,
    attn_mask, score_mod, mask_mod, mod_args, score_mod_grad, score_mod_args_grad; see
    :func:`numflash.attention`), tensors allowed. They run where numflash runs them (the CPU
    path and, on CUDA tensors, the tensor-core kernels take them all, forward and backward,
    cuda.row all but a block mask; cuda.block refuses them, naming them) and are differentiable in q, k and v, in
    ``attn_bias`` when it requires grad (its gradient has its shape: a broadcast bias gets the
    sum over the dims it broadcasts along), and in a mod_args tensor that requires grad when
    ``score_mod_args_grad`` gives its derivative (see numflash.attention_backward), not in the
    other modification tensors (one that requires grad is refused), and not through
    torch.compile yet.

    ``dropout_p``: attention dropout (numflash.dropout), differentiable as above; without a
    ``dropout_seed`` the seed is drawn from torch's default generator (so ``torch.manual_seed``
    makes it reproducible), and the backward regenerates the same mask.
    """
    if mods:  # (skipped when there are none: a plain call's host time counts, issue 14)
        mods = {name: value for name, value in mods.items() if value is not None}
        unknown = set(mods) - set(_api.MOD_OPTIONS)
        if unknown:
            raise TypeError(f"attention() got unexpected keyword arguments {sorted(unknown)}")
    if dropout_p:
        mods.update(_dropout_options(dropout_p, dropout_seed))
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        _check_tensors(q=q, k=k, v=v)  # raises; the rest is checked where the call runs
    name = _causal_name(causal)
    scale = _scale(softmax_scale, q.shape[-1] if q.dim() == 4 else 0)
    if out is not None:
        _check_tensors(q=q, k=k, v=v)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("out= writes into a tensor and cannot be differentiated: leave "
                             "out=None, or call under torch.no_grad()")
        _check_tensors(q=q, out=out)
        lse, _ = _forward_into(out, q, k, v, name, scale, layout, backend, algorithm, precision,
                               mods)
        return (out, lse) if return_lse else out
    if mods:  # their tensors as arrays now, while grad mode still says whether they train
        bias, trained, mods = _trainable(mods)
        o, lse = _ModsFunction.apply(q, k, v, bias, name, scale, layout, backend, algorithm,
                                     precision, bool(deterministic), _mod_arrays(mods),
                                     tuple(trained), *trained.values())
        return (o, lse) if return_lse else o
    o, lse = _run_forward(q, k, v, name, scale, layout, backend, algorithm, precision,
                          bool(deterministic))
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, layout="bhsd",
                       backend="auto", algorithm="auto", precision="auto", deterministic=False,
                       dq=None, dk=None, dv=None, grad_dtype=None, dropout_p=0.0,
                       dropout_seed=None, return_bias_grad=False, return_mod_args_grad=False,
                       **mods):
    """:func:`numflash.attention_backward` for torch tensors: returns (dq, dk, dv) tensors
    (and attn_bias's gradient with ``return_bias_grad``, mod_args' with
    ``return_mod_args_grad``).
    ``mods``: the modification options the forward ran with (see :func:`attention`), and its
    dropout_p and dropout_seed; ``grad_dtype``: None (q's dtype) or torch.float32 for 16-bit
    inputs."""
    _check_tensors(do=do, q=q, k=k, v=v, o=o, lse=lse)
    mods = {name: value for name, value in mods.items() if value is not None}
    if dropout_p:   # the forward's seed, given: numflash says so when it is missing
        mods.update(dropout_p=dropout_p, dropout_seed=dropout_seed)
    options = (_causal_name(causal), _scale(softmax_scale, q.shape[-1] if q.dim() == 4 else 0),
               layout, backend, algorithm, precision, bool(deterministic))
    if dq is None and dk is None and dv is None and not mods and grad_dtype is None \
            and not return_bias_grad and not return_mod_args_grad:
        return _attention_backward_op(do, q, k, v, o, lse, *options)
    if grad_dtype is not None:
        # checked by name before a tensor is made in it; numflash checks the given ones
        grad_dtype = getattr(torch, str(check_grad_dtype(grad_dtype, str(q.dtype)[6:])))
    grads = [g if g is not None else torch.empty(t.shape, dtype=grad_dtype or t.dtype,
                                                 device=t.device)
             for g, t in ((dq, q), (dk, k), (dv, v))]
    _check_tensors(q=q, dq=grads[0], dk=grads[1], dv=grads[2])
    return _backward_impl(do, q, k, v, o, lse, *options, grads=grads, mods=mods,
                          grad_dtype=grad_dtype, bias_grad=return_bias_grad,
                          mod_args_grad=return_mod_args_grad)


def attention_probabilities(q, k, *, causal=False, softmax_scale=None, layout="bhsd",
                            window_size=None, softcap=None, alibi_slopes=None):
    """The exact attention probabilities softmax(scale q k^T + mask) as a (B, H, Nq, Nk) tensor:
    a second pass, O(Nq Nk) memory by nature (for ``output_attentions`` / ``return_attn_probs``;
    the attention itself never builds it). Masked positions and rows that see no key are 0; a NaN
    score makes its row NaN. Computed in float32 for 16-bit inputs and returned in q's dtype;
    differentiable through q and k (torch's softmax, so the gradient is exact).
    ``window_size``, ``softcap`` and ``alibi_slopes`` as :func:`attention` takes them (numflash.
    mods: the softcap, then ALiBi, on the scaled score; the window from the causal alignment's
    diagonal)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd'; got {layout!r}")
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    nq, nk = q.shape[2], k.shape[2]
    if k.shape[1] != q.shape[1]:  # grouped-query attention; this pass is O(Nq Nk) anyway
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = _scale(softmax_scale, q.shape[-1])
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    s = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    name = _causal_name(causal)
    offset = nk - nq if name == "bottom_right" else 0
    rows = torch.arange(nq, device=q.device)[:, None] + offset   # the key aligned with each row
    keys = torch.arange(nk, device=q.device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if name != "none":
        visible = keys <= rows
    if window_size is not None:
        left, right = (int(w) for w in window_size)
        if left >= 0:
            visible = visible & (keys >= rows - left)
        if right >= 0:
            visible = visible & (keys <= rows + right)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, device=q.device).to(work)
        slopes = slopes.reshape((1,) * (2 - slopes.dim()) + tuple(slopes.shape))[..., None, None]
        s = s - slopes * (rows - keys).abs().to(work)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    p = torch.where(visible.any(dim=-1)[:, None], p, 0)  # a row with no key: 0, not NaN
    return p.to(q.dtype)


def merge_partials(outs, lses):
    """:func:`numflash.merge_partials` for torch tensors (CPU, or CUDA on torch's current
    stream): the attention over the union of disjoint key sets from the results over each,
    read through zero-copy views. Returns new (out, lse) tensors; not differentiable."""
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):  # numflash says so, naming the counts
        return _api_merge_partials(outs, lses)
    _check_tensors(**{f"outs[{i}]": t for i, t in enumerate(outs)},
                   **{f"lses[{i}]": t for i, t in enumerate(lses)})
    with _on_torch_stream(outs[0]):
        out, lse = _api_merge_partials(_views(*outs), _views(*lses))
    return _tensor(out, outs[0]), _tensor(lse, outs[0])


def _sdpa_refusals(attn_mask, enable_gqa, query, key):
    if attn_mask is not None and query.dim() > 4:
        raise NotImplementedError("numflash.torch.scaled_dot_product_attention: attn_mask with "
                                  "more than 4-D inputs is not supported; fold the leading "
                                  "dimensions into (N, H) first")
    if (not enable_gqa and query.dim() >= 3 and key.dim() >= 3
            and query.shape[-3] != key.shape[-3]):
        raise ValueError(f"numflash.torch.scaled_dot_product_attention: query has "
                         f"{query.shape[-3]} heads and key {key.shape[-3]}: pass enable_gqa=True "
                         f"for grouped-query attention (as torch's SDPA asks)")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics on numflash.

    query (..., L, E), key (..., S, E), value (..., S, Ev) with the same leading dimensions
    (usually (N, H)); ``is_causal`` is top-left aligned, as in torch; ``enable_gqa=True`` lets
    key and value have fewer heads (a divisor of query's), read in place. Differentiable.
    ``attn_mask``: a boolean mask (True = take part) or a float bias added to the scaled scores,
    broadcastable to (N, H, L, S), as in torch; it runs as a numflash modification
    (numflash.mods; read in place, on the tensor cores for CUDA tensors), where a row that the
    mask leaves empty gives zeros (torch gives NaN); a float one that requires grad gets its
    gradient (a trained bias), where the backward kernel computes it. ``dropout_p > 0`` drops
    attention probabilities as torch does (numflash.dropout's mask, its seed drawn from torch's default
    generator; pass 0.0 in evaluation, as with torch).
    """
    if (attn_mask is None and not dropout_p and type(query) is torch.Tensor and query.dim() == 4
            and type(key) is torch.Tensor and key.dim() == 4 and type(value) is torch.Tensor
            and (enable_gqa or query.shape[1] == key.shape[1])):  # the common call, straight in
        return _run_forward(query, key, value, "top_left" if is_causal else "none",
                            _scale(scale, query.shape[3]), "bhsd", "auto", "auto", "auto",
                            False)[0]
    _check_tensors(query=query, key=key, value=value)
    _sdpa_refusals(attn_mask, enable_gqa, query, key)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E); got shape "
                             f"{tuple(t.shape)}")
    lead = query.shape[:-2]
    for name, t in (("key", key), ("value", value)):
        if t.shape[:-3] != lead[:-1] or (not enable_gqa and t.shape[:-2] != lead):
            raise ValueError(f"{name}'s leading dimensions {tuple(t.shape[:-2])} must equal "
                             f"query's {tuple(lead)} (numflash does not broadcast them)")
    q4, k4, v4 = (_as_4d(t) for t in (query, key, value))
    mods = {}
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor; got {type(attn_mask).__name__}")
        mods["attn_mask" if attn_mask.dtype == torch.bool else "attn_bias"] = attn_mask
    out = attention(q4, k4, v4, causal=bool(is_causal), softmax_scale=scale, dropout_p=dropout_p,
                    **mods)
    return out.reshape(*lead, *out.shape[-2:])


def _as_4d(t):
    """(..., N, E) as (B, H, N, E): a view when the leading dimensions allow one."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:  # (H, N, E): dim -3 is heads, as torch reads it for enable_gqa
        return t.unsqueeze(0)
    if t.dim() == 2:
        return t[None, None]
    return t.reshape(-1, t.shape[-3], *t.shape[-2:])


def _flash_attn_mods(where, window_size, softcap, alibi_slopes, causal, lengths):
    """flash-attn's window_size, softcap and alibi_slopes as numflash modification options
    (numflash.mods), or a refusal naming the option. ``lengths``: (queries, keys) of each
    sequence the options apply to."""
    mods = {}
    if window_size is not None and tuple(window_size) != (-1, -1):
        mods["window_size"] = tuple(window_size)
    if softcap:
        mods["softcap"] = softcap
    if alibi_slopes is not None:
        mods["alibi_slopes"] = alibi_slopes
    if not causal and ("window_size" in mods or "alibi_slopes" in mods):
        for nq, nk in lengths:
            if nq != nk:
                # flash-attn measures both from the bottom-right diagonal even without causal
                # masking; numflash from the causal alignment's diagonal (top-left then)
                raise NotImplementedError(
                    f"{where}: a window or ALiBi with causal=False and {nq} queries != {nk} "
                    f"keys (flash-attn aligns them to the bottom right; numflash to the top "
                    f"left without causal)")
    return mods


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn's ``flash_attn_func`` on numflash: q (B, Nq, H, d), k and v (B, Nk, H, d), causal
    aligned to the bottom right (query i sees keys j <= i + Nk - Nq), differentiable. Also fp32,
    fp64, any head dim, Turing GPUs and CPUs.

    ``return_attn_probs=True`` returns (out, softmax_lse, probs) with softmax_lse (B, H, Nq) and
    the exact probabilities (B, H, Nq, Nk) (:func:`attention_probabilities`). k and v may have
    fewer heads than q (GQA / MQA). ``window_size``, ``softcap`` and ``alibi_slopes`` run as
    numflash modifications (gradients for q, k, v; on CUDA tensors on the tensor-core kernels,
    forward and backward). ``dropout_p > 0``: attention dropout (numflash.dropout; the seed
    drawn from torch's default generator). Windows as flash-attn reads them (_flash_window: a
    right side of 0 is bottom-right causal). Refused with NotImplementedError naming the
    option: another window or ALiBi with causal=False and Nq != Nk (see
    :func:`_flash_attn_mods`).

    ALiBi's output is flash-attn's; its lse is that of numflash's scores, s - slope |i + Nk - Nq
    - j|. flash-attn adds slope j instead where causal (the same softmax over the visible keys),
    so its softmax_lse is larger by slope (i + Nk - Nq) there; so for flash_attn_varlen_func
    and flash_attn_with_kvcache.
    """
    _check_tensors(q=q, k=k, v=v)
    causal, window_size = _flash_window(window_size, causal, k.shape[1] if k.dim() == 4 else None)
    mods = _flash_attn_mods("flash_attn_func", window_size, softcap, alibi_slopes, causal,
                            [(q.shape[1], k.shape[1])] if q.dim() == k.dim() == 4 else [])
    causal_mode = "bottom_right" if causal else False
    out, lse = attention(q, k, v, causal=causal_mode, softmax_scale=softmax_scale, layout="bshd",
                         return_lse=True, deterministic=deterministic, dropout_p=dropout_p,
                         **mods)
    if return_attn_probs:
        probs = attention_probabilities(q, k, causal=causal_mode, softmax_scale=softmax_scale,
                                        layout="bshd", **mods)
        return out, lse, probs
    return out


def _varlen_forward(q, k, v, cu_q, cu_k, causal, scale, options, out=None):
    """numflash.attention_varlen on packed tensors' memory, on torch's current stream: (out, lse
    (H, total_q)); ``out`` (total_q, H, dv) written when given. ``causal``: numflash's argument
    ("bottom_right" or False); ``options``: modification arrays and dropout."""
    from .varlen import attention_varlen
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q.dtype), device=q.device)
    with _on_torch_stream(q):   # views made here: DLPack orders them on torch's stream
        views = _views(q, k, v, cu_q, cu_k, out, lse)
        _, got = attention_varlen(*views[:5], causal=causal, softmax_scale=scale,
                                  return_lse=True, out=views[5], **options)
        views[6][...] = got
    return out, lse


def _varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, causal, scale, deterministic, options):
    """numflash.attention_varlen_backward on packed tensors' memory: [dq, dk, dv], new tensors."""
    from .varlen import attention_varlen_backward
    grads = [torch.empty_like(x) for x in (q, k, v)]
    with _on_torch_stream(q):
        views = _views(do.contiguous(), q, k, v, out, lse, cu_q, cu_k, *grads)
        attention_varlen_backward(*views[:8], causal=causal, softmax_scale=scale,
                                  deterministic=deterministic, dq=views[8], dk=views[9],
                                  dv=views[10], **options)
    return grads


class _VarlenFunction(torch.autograd.Function):
    """Packed sequences through numflash.attention_varlen and its backward on the tensors' memory
    (CUDA tensors: one launch per pass, cuda.mma's or on Hopper cuda.wgmma's, where those kernels
    take them, on torch's current stream); differentiable in q, k and v. ``options``: the
    modifications (arrays viewing their tensors) and dropout, which both passes take."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, deterministic, options):
        out, lse = _varlen_forward(q, k, v, cu_q, cu_k, causal, scale, options)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.options = (causal, scale, deterministic, options)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        _refuse_what_the_backward_cannot_do()
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        grads = _varlen_backward(d_out, q, k, v, out, lse, cu_q, cu_k, *ctx.options)
        return (*grads, None, None, None, None, None, None)


def _packed_arguments(where, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      causal, window_size=None, softcap=0.0, alibi_slopes=None):
    """A packed call's checked offsets (int32 tensors on q's device; NumPy-backed on the CPU)
    and its flash-attn options as numflash modification arrays, or a refusal naming the
    argument. Reads the lengths on the host (a device-to-host copy for CUDA offsets)."""
    from .varlen import _check_packed
    _check_tensors(q=q, k=k, v=v)
    lengths = [c.tolist() if isinstance(c, torch.Tensor) else c
               for c in (cu_seqlens_q, cu_seqlens_k)]
    cq, ck = _check_packed(q, k, v, *lengths, max_seqlen_q, max_seqlen_k, torch_ok=True)
    mods = _flash_attn_mods(where, window_size, softcap, alibi_slopes, causal,
                            zip((cq[1:] - cq[:-1]).tolist(), (ck[1:] - ck[:-1]).tolist()))
    if q.device.type == "cuda":   # the int32 offsets the one-launch kernels read, on q's GPU
        offsets = [c if isinstance(c, torch.Tensor) and c.device == q.device
                   and c.dtype == torch.int32 else torch.tensor(n, dtype=torch.int32,
                                                                device=q.device)
                   for c, n in zip((cu_seqlens_q, cu_seqlens_k), (cq, ck))]
    else:
        offsets = [torch.from_numpy(c) for c in (cq, ck)]
    return offsets, _mod_arrays(mods)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_func`` on numflash: packed q (total_q, H, d), k and v
    (total_k, Hk, d), cumulative lengths ``cu_seqlens_q/k`` (int32 tensors or lists, B + 1
    entries), causal aligned to the bottom right of each sequence; differentiable. Runs
    :func:`numflash.attention_varlen` and its backward on the tensors' memory (CUDA tensors:
    one launch per pass, cuda.mma's or on Hopper cuda.wgmma's, where those take them; otherwise
    one call per sequence on views of the packed tensors).

    ``return_attn_probs=True`` returns (out, softmax_lse (H, total_q), None): the per-sequence
    probabilities have no dense packed form. Takes and refuses what :func:`flash_attn_func`
    does; ``alibi_slopes`` of shape (B, H) give sequence b its row. ``dropout_p > 0`` draws one
    seed from torch's default generator and sequence b its mask under
    ``numflash.dropout.packed_seed(seed, b)`` (numflash.attention_varlen's rule). Not under
    torch.func transforms (vmap, grad): packed tensors have no batch to fold a mapped
    dimension into; :func:`flash_attn_func` takes them.
    """
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError("flash_attn_varlen_func does not run under torch.func "
                                  "transforms (vmap, grad): call it eagerly, or use "
                                  "flash_attn_func / numflash.torch.attention, which vmap")
    causal, window_size = _flash_window(window_size, causal, max_seqlen_k)
    offsets, options = _packed_arguments("flash_attn_varlen_func", q, k, v, cu_seqlens_q,
                                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         window_size, softcap, alibi_slopes)
    options.update(_dropout_options(dropout_p, None))
    out, lse = _VarlenFunction.apply(q, k, v, *offsets, "bottom_right" if causal else False,
                                     softmax_scale, bool(deterministic), options)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache`` on numflash (:func:`numflash.attention_with_kvcache`
    on the tensors' memory): q (B, Nq, H, d), caches (B, S, Hk, d) or paged (pages, page_size,
    Hk, d) with ``block_table``; k, v appended in place at ``cache_seqlens``; causal aligned to
    the bottom right. Inference only, as flash-attn's: no gradients. ``num_splits=0`` lets
    numflash choose. ``alibi_slopes`` ((H,) or (B, H)) with causal=True (each entry's
    distances from its newest row; its lse as :func:`flash_attn_func` says).
    Refused, naming the argument: rotary embeddings, cache_batch_idx, cache_leftpad."""
    from .kvcache import attention_with_kvcache
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not supported by "
                                      f"numflash yet")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    tensors.update({n: t for n, t in (("k", k), ("v", v)) if t is not None})
    _check_tensors(**tensors)
    extra = {n: t for n, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table))
             if isinstance(t, torch.Tensor)}
    arrays = dict(zip(list(tensors) + list(extra), _views(*tensors.values(), *extra.values())))
    options = {"softmax_scale": softmax_scale, "num_splits": num_splits or None}
    if window_size is not None and tuple(window_size) != (-1, -1):
        options["window_size"] = tuple(window_size)
    if softcap:
        options["softcap"] = softcap
    with _on_torch_stream(q):
        if alibi_slopes is not None:
            options.update(_mod_arrays({"alibi_slopes": alibi_slopes}))
        res = attention_with_kvcache(
            arrays["q"], arrays["k_cache"], arrays["v_cache"], arrays.get("k"), arrays.get("v"),
            arrays.get("cache_seqlens", cache_seqlens), arrays.get("block_table", block_table),
            causal=causal, return_lse=return_softmax_lse, **options)
    if return_softmax_lse:
        return _tensor(res[0], q), _tensor(res[1], q)
    return _tensor(res, q)


# ---- numflash as torch's SDPA flash implementation ----

SDPA_IMPL = "numflash"


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                        return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on numflash: query (B, H, Nq, d), key and
    value (B, Hk, Nk, .), SDPA's top-left causal. Returns what torch's flash kernel returns
    (out, lse, no cumulative lengths, Nq, Nk, the dropout state, no debug mask). With
    ``dropout_p`` numflash.dropout's mask: its seed, drawn from torch's default generator, is the
    state's first entry, which aten hands the backward as ``philox_seed``."""
    if return_debug_mask:
        raise RuntimeError("numflash's SDPA flash implementation returns no debug mask")
    causal, softmax_scale = "top_left" if is_causal else "none", _scale(scale, query.shape[-1])
    dropout = _dropout_options(dropout_p, None)
    with torch.no_grad():   # below autograd already: aten's formula calls the backward below
        if dropout:
            out = torch.empty(_out_shape(query, value, "bhsd"), dtype=query.dtype,
                              device=query.device)
            lse, _ = _forward_into(out, query, key, value, causal, softmax_scale, "bhsd", "auto",
                                   "auto", "auto", dropout)
        else:
            out, lse = _forward_impl(query, key, value, causal, softmax_scale, "bhsd", "auto",
                                     "auto", "auto")
    return (out, lse, None, None, query.shape[2], key.shape[2], *_flash_states(dropout, query))


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                         scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward`` on numflash's backward (with
    dropout, the forward's seed read back from ``philox_seed``: one small device-to-host
    copy); deterministic where torch.use_deterministic_algorithms asks for it."""
    dropout = {}
    if dropout_p:
        dropout = {"dropout_p": dropout_p, "dropout_seed": int(philox_seed[0].item())}
    with torch.no_grad():
        return _backward_impl(grad_out, query, key, value, out, logsumexp,
                              "top_left" if is_causal else "none",
                              _scale(scale, query.shape[-1]), "bhsd", "auto", "auto", "auto",
                              torch.are_deterministic_algorithms_enabled(), mods=dropout)


def _flash_refusals(return_debug_mask, seqused_k, alibi_slopes, block_table):
    if return_debug_mask:
        raise RuntimeError("numflash's flash attention implementation returns no debug mask")
    if seqused_k is not None or block_table is not None:
        raise NotImplementedError(
            "numflash's aten::_flash_attention_forward takes no seqused_k or block_table: for a "
            "KV cache call numflash.torch.flash_attn_with_kvcache")
    if alibi_slopes is not None:
        raise NotImplementedError(
            "numflash's aten::_flash_attention_forward refuses alibi_slopes: "
            "aten::_flash_attention_backward has none, so a gradient would silently lose them; "
            "numflash.torch.flash_attn_func and flash_attn_varlen_func take them")


def _flash_window(window_size, is_causal, max_k):
    """(causal, window) as flash-attn reads a (left, right) window (None entries unbounded): a
    side at least ``max_k`` wide (when given) is unbounded; causal means right = 0, and right =
    0 means causal (flash-attn measures windows from the bottom-right diagonal, so it is the
    bottom-right causal mask, whatever Nq and Nk). So torch's causal varlen_attn, which passes
    (-1, 0), runs as plain causal attention (no window modification, which cuda.wgmma does
    not take)."""
    try:
        left, right = (-1 if w is None else int(w) for w in
                       ((-1, -1) if window_size is None else window_size))
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be (left, right) integers (-1 = unbounded); got "
                         f"{window_size!r}") from None
    if max_k:
        left, right = (-1 if w >= int(max_k) else w for w in (left, right))
    if is_causal or right == 0:
        return True, (left, -1)
    return False, (left, right)


def _flash_states(dropout, query):
    """What torch's flash forwards return after the lse: the (seed, 0) rng state (zeros without
    dropout), the unused offset and an empty debug mask."""
    device = query.device
    if not dropout:
        state = torch.zeros(2, dtype=torch.uint64, device=device)
    else:
        state = torch.tensor([dropout["dropout_seed"], 0], dtype=torch.uint64, device=device)
    return (state, torch.zeros((), dtype=torch.uint64, device=device),
            torch.empty(0, dtype=query.dtype, device=device))


def _flash_options(where, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                   window, dropout):
    """What aten's flash forward and backward both need: (the packed offsets, or None for
    (B, N, H, d) tensors; the modification and dropout options)."""
    if cum_seq_q is None and cum_seq_k is None:
        offsets, options = None, _flash_attn_mods(where, window, 0.0, None, is_causal,
                                                  [(query.shape[1], key.shape[1])])
    else:
        offsets, options = _packed_arguments(where, query, key, value, cum_seq_q, cum_seq_k,
                                             max_q, max_k, is_causal, window)
    options.update(dropout)
    return offsets, options


def _flash_forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, window, scale):
    """The body of aten::_flash_attention_forward (and its in-place form): (out, lse, dropout
    options). ``is_causal`` and ``window`` as _flash_window gives them."""
    where = "aten::_flash_attention_forward"
    _check_tensors(query=query, key=key, value=value)
    softmax_scale = _scale(scale, query.shape[-1])
    dropout = _dropout_options(dropout_p, None)
    offsets, options = _flash_options(where, query, key, value, cum_seq_q, cum_seq_k, max_q,
                                      max_k, is_causal, window, dropout)
    with torch.no_grad():   # below autograd already: aten's formula calls the backward below
        if offsets is None:   # (B, N, H, d)
            if out is None:
                out = torch.empty(_out_shape(query, value, "bshd"), dtype=query.dtype,
                                  device=query.device)
            lse, _ = _forward_into(out, query, key, value,
                                   "bottom_right" if is_causal else "none", softmax_scale,
                                   "bshd", "auto", "auto", "auto", options)
            return out, lse, dropout
        out, lse = _varlen_forward(query, key, value, *offsets,
                                   "bottom_right" if is_causal else False, softmax_scale,
                                   options, out=out)
    return out, lse, dropout


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None,
                   window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                   num_splits=None):
    """``aten::_flash_attention_forward`` on numflash, with flash-attn's conventions (causal
    and windows aligned to the bottom right): packed query (total_q, H, d), key and value
    (total_k, Hk, d) with ``cum_seq_q/k`` (what torch.nn.attention.varlen.varlen_attn calls;
    one launch per pass on CUDA tensors where numflash's packed kernels take them), or (B, N, H,
    d) tensors without. Returns (out, lse, rng_state, unused, debug mask) with lse (H, total_q)
    packed, (B, H, Nq) otherwise; with ``dropout_p`` the seed (numflash.dropout, drawn from
    torch's default generator) is rng_state's first entry. ``num_splits`` is a tuning hint that
    numflash's planner does not need. Windows as flash-attn reads them (_flash_window). Refused
    by name: a debug mask, seqused_k and block_table, alibi_slopes (see _flash_refusals).
    Packed calls read the offsets on the host (a device-to-host copy each pass), so they cannot
    be captured in a CUDA graph."""
    _flash_refusals(return_debug_mask, seqused_k, alibi_slopes, block_table)
    out, lse, dropout = _flash_forward_into(None, query, key, value, cum_seq_q, cum_seq_k, max_q,
                                            max_k, dropout_p, *_flash_window(
                                                (window_size_left, window_size_right),
                                                is_causal, max_k), scale)
    return (out, lse, *_flash_states(dropout, query))


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                           dropout_p, is_causal, return_debug_mask, *, scale=None,
                           window_size_left=None, window_size_right=None, seqused_k=None,
                           alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward_no_dropout_inplace`` (varlen_attn_out's call): the
    forward into ``out``; returns the lse."""
    if dropout_p:
        raise ValueError(f"aten::_flash_attention_forward_no_dropout_inplace takes no dropout; "
                         f"got dropout_p={dropout_p!r}")
    _flash_refusals(return_debug_mask, seqused_k, alibi_slopes, block_table)
    _check_tensors(query=query, out=out)
    return _flash_forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0,
                               *_flash_window((window_size_left, window_size_right), is_causal,
                                              max_k), scale)[1]


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                    window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward`` on numflash's backward, packed or not as the forward
    was (dq, dk, dv); the dropout seed read back from ``rng_state`` (one small device-to-host
    copy); deterministic where torch.use_deterministic_algorithms asks for it."""
    where = "aten::_flash_attention_backward"
    is_causal, window = _flash_window((window_size_left, window_size_right), is_causal, max_k)
    softmax_scale = _scale(scale, query.shape[-1])
    deterministic = torch.are_deterministic_algorithms_enabled()
    dropout = {}
    if dropout_p:
        dropout = {"dropout_p": dropout_p, "dropout_seed": int(rng_state[0].item())}
    offsets, options = _flash_options(where, query, key, value, cum_seq_q, cum_seq_k, max_q,
                                      max_k, is_causal, window, dropout)
    with torch.no_grad():
        if offsets is None:
            return _backward_impl(grad_out, query, key, value, out, logsumexp,
                                  "bottom_right" if is_causal else "none", softmax_scale,
                                  "bshd", "auto", "auto", "auto", deterministic, mods=options)
        return tuple(_varlen_backward(grad_out, query, key, value, out, logsumexp, *offsets,
                                      "bottom_right" if is_causal else False, softmax_scale,
                                      deterministic, options))


class _SdpaHandle:
    """What activate_flash_attention_impl keeps: the aten kernels' registration, removed on
    restore_flash_attention_impl (torch's own flash kernels come back)."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None


_SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": _sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_flash_backward,
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
    "_flash_attention_backward": _flash_backward,
}


def _register_sdpa_kernels():
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    for name, kernel in _SDPA_KERNELS.items():
        if hasattr(torch.ops.aten, name):   # (the in-place forward is newer than the others)
            lib.impl(name, kernel, "CUDA")
    return _SdpaHandle(lib)


def install_as_sdpa():
    """Make numflash torch's SDPA flash implementation: afterwards unchanged code calling
    ``torch.nn.functional.scaled_dot_product_attention`` runs numflash's CUDA kernels (forward
    and backward) wherever torch picks its flash backend (float16 / bfloat16 CUDA tensors it
    judges flash-able); torch picks its other backends for the rest, as before. So does
    ``torch.nn.attention.varlen.varlen_attn`` (packed sequences: aten::_flash_attention_forward
    and _backward, see _flash_forward).
    ``torch.nn.attention.restore_flash_attention_impl()`` undoes it. Needs a torch with
    ``torch.nn.attention.register_flash_attention_impl``; returns the registered name.

    Inside, inputs numflash cannot run raise (no silent fallback to torch's kernel, which the
    registration replaces): what :func:`numflash.explain` refuses. ``dropout_p > 0`` (torch's
    training mode) runs numflash.dropout, its seed kept in the state torch's flash kernel
    returns."""
    from torch.nn import attention as _attention
    if not hasattr(_attention, "register_flash_attention_impl"):
        raise NotImplementedError(f"torch {torch.__version__} has no "
                                  f"torch.nn.attention.register_flash_attention_impl (torch "
                                  f"2.11 and newer have it): numflash cannot install itself as "
                                  f"SDPA's flash kernel; call numflash.torch."
                                  f"scaled_dot_product_attention instead")
    _attention.register_flash_attention_impl(SDPA_IMPL, register_fn=_register_sdpa_kernels)
    _attention.activate_flash_attention_impl(SDPA_IMPL)
    return SDPA_IMPL
