"""Ring attention: exact attention over a sequence sharded across processes (torch.distributed).

Each of P ranks holds a shard of q, k and v along the sequence. The K/V shards travel round the
ring (rank r sends to r + 1 and receives from r - 1, one ``batch_isend_irecv`` per step, on the
process group's own stream) while each rank runs :func:`numflash.attention` on the block in hand;
the partial results are merged by :func:`numflash.merge_partials` (on CUDA tensors the
cuda.merge kernel split-KV uses), so the result is exact. The backward sends dK/dV accumulators
round the ring behind the K/V blocks and returns each rank the gradients of its own shard.

Sharding (:func:`shard`, :func:`unshard`, :func:`shard_positions`):

- ``"zigzag"`` (the default): the sequence is cut into 2P equal chunks and rank r holds chunks r
  and 2P - 1 - r. Under a causal mask every rank then does the same work at every step (a full
  block, or half its queries against all keys, or half its keys against all queries), so no rank
  waits for another; with plain contiguous shards rank P - 1 does P times rank 0's causal work.
- ``"contiguous"``: rank r holds tokens [r N/P, (r + 1) N/P). Balanced without a causal mask.

Works on torch tensors: CUDA tensors over an NCCL process group, CPU tensors over gloo. Every call
first compares its shapes and options across ranks (one small all_gather): a rank whose shard or
options differ makes every rank raise the same ValueError instead of hanging. Any collective that
does not complete is bounded by the process group's timeout (``init_process_group(timeout=...)``).
"""
import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import torch as _nt
from .inputs import softmax_scale_value

__all__ = ["ring_attention", "shard", "unshard", "shard_positions", "SHARDINGS"]

SHARDINGS = ("zigzag", "contiguous")
_SEQ_DIM = {"bhsd": 2, "bshd": 1}
_HEAD_DIM = {"bhsd": 1, "bshd": 2}
_CAUSAL_MODES = (False, None, True, "top_left", "bottom_right")


# ---- sharding helpers ----

def _chunks(n, world_size, sharding):
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}; got {sharding!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer; got {world_size!r}")
    parts = world_size * (2 if sharding == "zigzag" else 1)
    if n % parts:
        raise ValueError(f"a sequence of {n} tokens does not split into {parts} equal chunks "
                         f"({sharding} sharding over {world_size} ranks): pad it to a multiple "
                         f"of {parts}")
    return n // parts


def shard_positions(n, rank, world_size, *, sharding="zigzag"):
    """The global token positions that ``rank`` holds, in the order it holds them (a torch int64
    tensor): what position embeddings (RoPE, ALiBi) of a shard must use."""
    c = _chunks(n, world_size, sharding)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
    if sharding == "contiguous":
        return torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world_size - 1 - rank) * c,
                                   (2 * world_size - rank) * c)])


def shard(x, rank, world_size, *, sharding="zigzag", seq_dim=2):
    """Rank ``rank``'s shard of the whole-sequence tensor ``x`` (a view for contiguous sharding,
    a new tensor for zigzag)."""
    c = _chunks(x.shape[seq_dim], world_size, sharding)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
    if sharding == "contiguous":
        return x.narrow(seq_dim, rank * c, c)
    return torch.cat([x.narrow(seq_dim, rank * c, c),
                      x.narrow(seq_dim, (2 * world_size - 1 - rank) * c, c)], dim=seq_dim)


def unshard(shards, *, sharding="zigzag", seq_dim=2):
    """The whole-sequence tensor from every rank's shard, given in rank order (the inverse of
    :func:`shard`)."""
    shards = list(shards)
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}; got {sharding!r}")
    if not shards or len({s.shape[seq_dim] for s in shards}) != 1:
        raise ValueError("unshard needs one shard per rank, all of the same length")
    if sharding == "contiguous":
        return torch.cat(shards, dim=seq_dim)
    n = shards[0].shape[seq_dim]
    if n % 2:
        raise ValueError(f"zigzag shards hold two equal chunks; got a shard of length {n}")
    firsts = [s.narrow(seq_dim, 0, n // 2) for s in shards]
    seconds = [s.narrow(seq_dim, n // 2, n // 2) for s in reversed(shards)]
    return torch.cat(firsts + seconds, dim=seq_dim)


# ---- the work of one ring step ----

@dataclass(frozen=True)
class _Ring:
    group: object
    rank: int
    world: int
    causal: bool
    scale: float
    layout: str
    sharding: str
    options: tuple          # (name, value) pairs for numflash.torch.attention / _backward
    communicate: bool = True  # False: reuse the local K/V in place of received blocks (timing)
    head_chunks: int = 1      # run the ring this many times, each over a slice of the heads

    @property
    def seq_dim(self):
        return _SEQ_DIM[self.layout]


def _pieces(ring, src, n_q, n_k):
    """What rank ``ring.rank`` computes with the K/V shard of rank ``src``: a list of
    (query range, key range, causal) over the local shards; ranges are (start, length)."""
    everything = [((0, n_q), (0, n_k), False)]
    if not ring.causal:
        return everything
    if src == ring.rank:  # the diagonal block: causal over the local tokens, in either sharding
        return [((0, n_q), (0, n_k), True)]
    if ring.sharding == "contiguous":
        return everything if src < ring.rank else []
    c = n_q // 2  # zigzag: chunks (r, 2P-1-r) against chunks (src, 2P-1-src)
    if src < ring.rank:   # every local query sees src's first chunk, none its second
        return [((0, n_q), (0, c), False)]
    return [((c, c), (0, n_k), False)]  # src > r: only the second local chunk sees src's keys


def _rows(x, ring, start, length):
    return x.narrow(ring.seq_dim, start, length)


def _merge_into(out_acc, lse_acc, out_part, lse_part, layout):
    """out_acc, lse_acc <- the merge of (out_acc, lse_acc) and (out_part, lse_part) by
    numflash.merge_partials (its one rule; on CUDA tensors cuda.merge's kernel), written back
    into the accumulators. merge_partials pairs each output row with its lse entry: with
    layout "bshd" the lse (B, H, N) is viewed as (B, N, H) to match the output's rows."""
    def rows(lse):
        return lse if layout == "bhsd" else lse.transpose(1, 2)
    out, lse = _nt.merge_partials([out_acc, out_part.to(out_acc.dtype)],
                                  [rows(lse_acc), rows(lse_part)])
    out_acc.copy_(out)
    rows(lse_acc).copy_(lse)


def _exchange(ring, send, recv):
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one;
    returns the works to wait on."""
    if not ring.communicate:
        for s, r in zip(send, recv):
            r.copy_(s)
        return []
    nxt = dist.get_global_rank(ring.group, (ring.rank + 1) % ring.world) \
        if ring.group is not None else (ring.rank + 1) % ring.world
    prv = dist.get_global_rank(ring.group, (ring.rank - 1) % ring.world) \
        if ring.group is not None else (ring.rank - 1) % ring.world
    ops = [dist.P2POp(dist.isend, s, nxt, ring.group) for s in send]
    ops += [dist.P2POp(dist.irecv, r, prv, ring.group) for r in recv]
    return dist.batch_isend_irecv(ops)


def _wait(works):
    for w in works:
        w.wait()


class _finishing:
    """If the block raises, wait for the transfers in flight before the error goes on: every
    rank posted them, so they complete, and the process group stays usable (gloo's would
    otherwise time out on its next collective)."""

    def __init__(self, works):
        self.works = works

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is not None:
            try:
                _wait(self.works)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        return False


# The accumulators' dtype follows the lse's rule (float64 for float64 inputs, else float32), and
# the lse's shape is numflash.torch's: one rule each, not copies.
_acc_dtype = _nt._lse_dtype
_lse_shape = _nt._lse_shape


def _ring_forward_heads(q, k, v, ring):
    """(out in q's dtype, lse) of attention over the whole ring's keys, for the local queries."""
    n_q, n_k = q.shape[ring.seq_dim], k.shape[ring.seq_dim]
    acc = _acc_dtype(q.dtype)
    out_shape = list(q.shape)
    out_shape[-1] = v.shape[-1]
    out_acc = torch.zeros(out_shape, dtype=acc, device=q.device)
    lse_acc = torch.full(_lse_shape(q, ring.layout), -math.inf, dtype=acc, device=q.device)
    opts = dict(ring.options)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        works, incoming = [], None
        if step + 1 < ring.world:  # the next block travels while this one is computed
            incoming = [torch.empty_like(t) for t in kv]
            works = _exchange(ring, kv, incoming)
        with _finishing(works):
            for (q0, nq), (k0, nk), causal in _pieces(ring, src, n_q, n_k):
                o, lse = _nt.attention(_rows(q, ring, q0, nq), _rows(kv[0], ring, k0, nk),
                                       _rows(kv[1], ring, k0, nk), causal=causal,
                                       softmax_scale=ring.scale, layout=ring.layout,
                                       return_lse=True, **opts)
                _merge_into(_rows(out_acc, ring, q0, nq), lse_acc.narrow(2, q0, nq), o,
                            lse.to(acc), ring.layout)
        _wait(works)
        if incoming is not None:
            kv = incoming
    return out_acc.to(q.dtype), lse_acc.to(_nt._lse_dtype(q.dtype))


def _ring_backward_heads(do, q, k, v, out, lse, ring):
    """(dq, dk, dv) of the local shards. The gradients of each K/V block are summed as the block
    travels: each rank adds its part to the block's accumulators and passes them on, one step
    behind the block; after P steps they reach the block's owner."""
    n_q, n_k = q.shape[ring.seq_dim], k.shape[ring.seq_dim]
    acc = _acc_dtype(q.dtype)
    opts = dict(ring.options)
    # Each step's gradients come out in the accumulators' dtype (grad_dtype: for 16-bit inputs
    # the kernels' float32 accumulators, unrounded), since gradients rounded to 16 bits at every
    # step and then summed miss the accuracy rule (seen for fp16 dV on 2 ranks).
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device),
           torch.zeros(v.shape, dtype=acc, device=v.device)]
    dkv_works, dkv_incoming = [], None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        works, incoming = [], None
        if step + 1 < ring.world:
            incoming = [torch.empty_like(t) for t in kv]
            works = _exchange(ring, kv, incoming)
        parts = []
        with _finishing(works + list(dkv_works)):
            for (q0, nq), (k0, nk), causal in _pieces(ring, src, n_q, n_k):
                g = _nt.attention_backward(
                    _rows(do, ring, q0, nq), _rows(q, ring, q0, nq), _rows(kv[0], ring, k0, nk),
                    _rows(kv[1], ring, k0, nk), _rows(out, ring, q0, nq),
                    lse.narrow(2, q0, nq), causal=causal, softmax_scale=ring.scale,
                    layout=ring.layout, grad_dtype=acc, **opts)
                _rows(dq, ring, q0, nq).add_(g[0])
                parts.append((k0, nk, g[1], g[2]))
        _wait(dkv_works)  # this block's accumulators, from the previous rank
        if dkv_incoming is not None:
            dkv = dkv_incoming
        for k0, nk, gk, gv in parts:
            _rows(dkv[0], ring, k0, nk).add_(gk)
            _rows(dkv[1], ring, k0, nk).add_(gv)
        if ring.world > 1:  # pass them on; the last pass brings each rank its own
            dkv_incoming = [torch.empty_like(t) for t in dkv]
            dkv_works = _exchange(ring, dkv, dkv_incoming)
        _wait(works)
        if incoming is not None:
            kv = incoming
    _wait(dkv_works)
    if dkv_incoming is not None:
        dkv = dkv_incoming
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _head_slices(ring, q, k):
    """((query head start, count), (K/V head start, count)) of each head chunk: whole GQA groups,
    so every query head's K/V head is in its chunk."""
    hq, hk = q.shape[_HEAD_DIM[ring.layout]], k.shape[_HEAD_DIM[ring.layout]]
    per = hk // ring.head_chunks
    group = hq // hk
    return [((i * per * group, per * group), (i * per, per)) for i in range(ring.head_chunks)]


def _heads(x, ring, start, count):
    return x.narrow(_HEAD_DIM[ring.layout], start, count)


def _ring_forward(q, k, v, ring):
    """The ring forward, over all heads at once or, with head_chunks, one slice of the heads at a
    time: the accumulator and the K/V block in flight are then that slice's (memory / chunks)."""
    if ring.head_chunks == 1:
        return _ring_forward_heads(q, k, v, ring)
    out_shape = list(q.shape)
    out_shape[-1] = v.shape[-1]
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, ring.layout), dtype=_nt._lse_dtype(q.dtype), device=q.device)
    for (h0, nh), (g0, ng) in _head_slices(ring, q, k):
        o, l = _ring_forward_heads(_heads(q, ring, h0, nh), _heads(k, ring, g0, ng),
                                   _heads(v, ring, g0, ng), ring)
        _heads(out, ring, h0, nh).copy_(o)
        lse.narrow(1, h0, nh).copy_(l)
    return out, lse


def _ring_backward(do, q, k, v, out, lse, ring):
    """The ring backward, all heads at once or one head chunk at a time (as the forward)."""
    if ring.head_chunks == 1:
        return _ring_backward_heads(do, q, k, v, out, lse, ring)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for (h0, nh), (g0, ng) in _head_slices(ring, q, k):
        parts = _ring_backward_heads(
            _heads(do, ring, h0, nh), _heads(q, ring, h0, nh), _heads(k, ring, g0, ng),
            _heads(v, ring, g0, ng), _heads(out, ring, h0, nh), lse.narrow(1, h0, nh), ring)
        for g, part, (start, count) in zip(grads, parts, ((h0, nh), (g0, ng), (g0, ng))):
            _heads(g, ring, start, count).copy_(part)
    return tuple(grads)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        if torch.is_grad_enabled():  # create_graph=True: the ring backward is not differentiable
            raise NotImplementedError("ring_attention has no double backward (create_graph=True)")
        dq, dk, dv = _ring_backward(d_out, *ctx.saved_tensors, ctx.ring)
        return dq, dk, dv, None


# ---- checks: every rank agrees, or every rank raises ----

_SIGNATURE_FIELDS = ("inputs accepted", "q shape", "k shape", "v shape", "dtypes", "causal",
                     "softmax_scale", "layout", "sharding", "requires grad", "head_chunks",
                     "options (backend, algorithm, precision, deterministic)")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_OPTIONS = ("backend", "algorithm", "precision", "deterministic")


def _local_problem(q, k, v, causal, layout, sharding, head_chunks, options, grad):
    """The reason this rank's call cannot run, or None. Checked before any collective, so a bad
    argument on one rank makes every rank raise (through the signatures) instead of leaving the
    others waiting: the ring's own arguments here, the shards and options by numflash's checks
    (explain on the whole local shards, forward and, if gradients are wanted, backward)."""
    if causal not in _CAUSAL_MODES:
        return ValueError(f"causal must be one of False, True, 'top_left', 'bottom_right'; got "
                          f"{causal!r}")
    if layout not in _SEQ_DIM:
        return ValueError(f"layout must be 'bhsd' or 'bshd'; got {layout!r}")
    if sharding not in SHARDINGS:
        return ValueError(f"sharding must be one of {SHARDINGS}; got {sharding!r}")
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        return TypeError(f"ring_attention got unexpected options {sorted(unknown)}; it takes "
                         f"{_OPTIONS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            order = "(B, H, N, d)" if layout == "bhsd" else "(B, N, H, d)"
            return ValueError(f"{name} must be 4-D {order} for layout={layout!r}; got shape "
                              f"{tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        return TypeError(f"q has dtype {q.dtype}; ring_attention takes {_DTYPES}")
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        return ValueError(f"q is on {q.device} but the current CUDA device is "
                          f"{torch.cuda.current_device()}: call torch.cuda.set_device first "
                          f"(NCCL runs on the current device)")
    from . import api  # the shards and options as numflash would check them
    try:
        for backward in (False, True) if grad else (False,):
            api.explain(q, k, v, layout=layout, backward=backward, **options)
    except (TypeError, ValueError, NotImplementedError) as e:
        return e
    sd = _SEQ_DIM[layout]
    if causal and q.shape[sd] != k.shape[sd]:
        return ValueError(f"causal ring attention is self-attention: q and k shards must be of "
                          f"one length; got {q.shape[sd]} and {k.shape[sd]}")
    if causal and sharding == "zigzag" and q.shape[sd] % 2:
        return ValueError(f"a zigzag shard holds two equal chunks: its length must be even; got "
                          f"{q.shape[sd]} (numflash.distributed.shard makes them)")
    hk = k.shape[_HEAD_DIM[layout]]
    if not isinstance(head_chunks, int) or not 1 <= head_chunks <= max(hk, 1) \
            or hk % head_chunks:
        return ValueError(f"head_chunks must be a positive integer dividing the {hk} K/V heads; "
                          f"got {head_chunks!r}")
    return None


def _stable_hash(text):
    """A 63-bit hash of a string, equal in every process (Python's hash() is salted)."""
    import hashlib
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _signature(q, k, v, causal, scale, layout, sharding, head_chunks, options, grad, problem):
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else (0, 0, 0, 0)
              for t in (q, k, v)]
    dtypes = tuple(str(t.dtype) if isinstance(t, torch.Tensor) else "?" for t in (q, k, v))
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    return [int(problem is None), *shapes[0], *shapes[1], *shapes[2], _stable_hash(str(dtypes)),
            _stable_hash(repr(causal)), scale_bits, _stable_hash(repr(layout)),
            _stable_hash(repr(sharding)), int(grad),
            head_chunks if isinstance(head_chunks, int) and 0 <= head_chunks < 2 ** 62 else -1,
            _stable_hash(repr(sorted(options.items(), key=str)))]


def _field(index):
    """The signature field an index falls in."""
    bounds = [1, 5, 9, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    return _SIGNATURE_FIELDS[next(i for i, b in enumerate(bounds) if index < b)]


def _agree(rank, world, group, signature, device, problem):
    """All-gather every rank's signature; raise the same error on every rank unless all agree.
    (On NCCL, reading the gathered signatures waits for the GPU work queued before: check=True
    costs one host synchronization per call.)"""
    mine = torch.tensor(signature, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [e.tolist() for e in every]
    if problem is not None:
        raise problem
    refused = [r for r, row in enumerate(rows) if not row[0]]
    if refused:
        raise ValueError(f"ring_attention: the inputs of rank(s) {refused} were refused (their "
                         f"error says why); every rank stops")
    for r, row in enumerate(rows):
        if row != rows[0]:
            i = next(i for i, (a, b) in enumerate(zip(row, rows[0])) if a != b)
            raise ValueError(f"ring_attention: rank {r} differs from rank 0 in {_field(i)} "
                             f"(every rank must pass shards of one length and the same options)")


def _group_facts(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group, or torchrun)")
    return dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group))


def ring_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, layout="bhsd",
                   sharding="zigzag", head_chunks=1, return_lse=False, check=True, **options):
    """Exact attention over a sequence sharded across the ranks of ``group`` (ring attention).

    q, k, v: this rank's shards, in ``layout`` ("bhsd": (B, H, n, d); "bshd": (B, n, H, d)),
    every rank's of one shape; made by :func:`shard` with the same ``sharding``. k and v may have
    Hk heads dividing H (grouped-query attention). The result is this rank's shard of the output
    of attention over the whole sequence (and with ``return_lse`` its (B, H, n) lse), the same as
    one :func:`numflash.attention` call on the whole sequence, to within the accuracy rule.

    causal: False, or True (queries see keys at or before their global position; "top_left" and
        "bottom_right" mean the same here, since q and k cover one sequence).
    sharding: "zigzag" (default; balances causal work) or "contiguous": see the module's text.
    head_chunks: run the ring once per slice of the heads (this many slices, dividing the K/V
        heads): the float32 accumulators and the K/V block in flight shrink by this factor, for
        more, shorter ring passes. 1 (the default) is fastest; raise it when memory is short.
    check: compare shapes and options across ranks first (one small all_gather; every rank
        raises the same error if they differ). Leave it on unless every call is known good.
    options: passed to each local :func:`numflash.torch.attention` and its backward (backend,
        algorithm, precision, deterministic).

    Differentiable: ``loss.backward()`` runs the ring backward on every rank (every rank must
    call backward). CUDA tensors need an NCCL group, CPU tensors a gloo group.
    """
    rank, world, backend = _group_facts(group)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v))
    problem = _local_problem(q, k, v, causal, layout, sharding, head_chunks, options, grad)
    scale = float("nan")
    if problem is None:
        try:
            scale = softmax_scale_value(softmax_scale, q.shape[-1])
        except (TypeError, ValueError) as e:
            problem = e
    if problem is None:
        wants = "nccl" if q.device.type == "cuda" else "gloo"
        if wants not in backend:
            problem = ValueError(f"{q.device.type} tensors need a process group with the {wants} "
                                 f"backend; this group's is {backend!r}")
    # the signatures travel on the device the group's backend takes
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend \
        else torch.device("cpu")
    if check:
        _agree(rank, world, group, _signature(q, k, v, causal, scale, layout, sharding,
                                              head_chunks, options, grad, problem),
               device, problem)
    elif problem is not None:
        raise problem
    ring = _Ring(group, rank, world, bool(causal), scale, layout, sharding,
                 tuple(sorted(options.items())), head_chunks=head_chunks)
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out
