"""Hugging Face transformers: run every attention layer of a model through numflash.

    name = numflash.transformers.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

:func:`register` adds an attention function to ``transformers.AttentionInterface`` and, under the
same name, a mask function to ``transformers.masking_utils.AttentionMaskInterface``. Two facts of
transformers 5.x shape it. Any implementation name containing "flash" is taken for a flash-attn
kernel and fails to load without flash-attn's own functions, so the name is ``"nf_attention"``.
And without a registered mask function, an attention function gets ``attention_mask=None``: a
left-padded batch would attend to its padding. The mask function registered here hands numflash
the most compact mask it can use, the (B, kv_len) key-padding vector (None without padding), and
refuses mask patterns numflash cannot run yet (chunked attention, bidirectional windows, custom
masks), never dropping them. Sliding-window causal layers (Mistral, Qwen2, Gemma 2/3) run with
numflash's window, taken from the layer's ``sliding_window`` keyword as transformers' flash-attn
path takes it, and Gemma 2's ``softcap`` as numflash's softcap.

Packed sequences (several sequences in one batch row, found by transformers from position_ids
that restart) reach the mask function as transformers' packed-sequence mask pattern; it hands on
the (B, N) integer sequence ids, and the attention function runs every sequence in one
:func:`numflash.torch.flash_attn_varlen_func` call (one launch per pass on CUDA). flash-attn's
keyword arguments ``cu_seq_lens_q/k`` (DataCollatorWithFlattening) take the same path.

A padded batch runs one numflash call per sequence on its kept keys [s, e) and on the query rows
at those positions: with a causal mask that slice is bottom-right-aligned causal attention,
exactly, whether the padding is on the left, the right or both. Query rows at padding positions
give zeros.
"""
import torch

from . import torch as _nt

NAME = "nf_attention"


def _mask_functions():
    from transformers import masking_utils
    return {masking_utils.causal_mask_function: True,
            masking_utils.bidirectional_mask_function: False}


def _closure(fn, name):
    """The closure variables of ``fn`` if it is the inner function that transformers'
    ``name`` returns, else None."""
    import inspect
    if getattr(fn, "__qualname__", "") != f"{name}.<locals>." + (
            "and_mask" if name == "and_masks" else "inner_mask"):
        return None
    return inspect.getclosurevars(fn).nonlocals


def _base_pattern(mask_function):
    """(causal, window) of the mask patterns numflash runs: transformers' causal and
    bidirectional ones (window None) and its sliding-window causal one (and_masks of
    sliding_window_overlay(W) and the causal mask: key j seen by query i when i - W < j <= i),
    window W; None for any other."""
    if mask_function in _mask_functions():
        return _mask_functions()[mask_function], None
    both = _closure(mask_function, "and_masks")
    functions = list(both.get("mask_functions", ())) if both else []
    if len(functions) == 2 and _mask_functions().get(functions[1]) is True:
        overlay = _closure(functions[0], "sliding_window_overlay")
        if overlay is not None:
            return True, int(overlay["sliding_window"])
    return None


def _packed_pattern(mask_function):
    """(sequence ids (B, N), (causal, window)) if ``mask_function`` is transformers'
    packed-sequence pattern over a mask :func:`_base_pattern` takes, else None: ``and_masks`` of
    the ids' equality (packed_sequence_mask_function) and the mask, on positions remapped to each
    sequence (remap_positions_for_packed_sequence, transformers 5.2x) or as it is (older 5.x,
    causal and bidirectional only). Read from the pattern's closures, so any other composition
    stays refused."""
    both = _closure(mask_function, "and_masks")
    functions = list(both.get("mask_functions", ())) if both else []
    ids = [_closure(f, "packed_sequence_mask_function") for f in functions]
    if len(functions) != 2 or sum(i is not None for i in ids) != 1:
        return None
    same = next(i for i in ids if i is not None)
    other = functions[ids.index(None)]
    remap = _closure(other, "remap_positions_for_packed_sequence")
    base = _base_pattern(remap.get("mask_function")) if remap else \
        (_base_pattern(other) if other in _mask_functions() else None)
    if base is None:
        return None
    return same["packed_sequence_mask"], base


def key_padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                     mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask function for numflash: the (B, kv_length) boolean key-padding mask, or
    None when no key is padding; for packed sequences the (B, N) int64 sequence ids. Causal and
    bidirectional patterns are the attention function's ``is_causal``; any other pattern is
    refused."""
    packed = _packed_pattern(mask_function) if mask_function is not None else None
    if packed is not None:
        return packed[0].to(torch.int64)
    # None: transformers' default, causal
    pattern = _base_pattern(mask_function) if mask_function is not None else (True, None)
    if pattern is None:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise NotImplementedError(
            f"numflash's transformers attention takes causal, sliding-window causal or "
            f"bidirectional masks with key padding; this model asked for the mask pattern "
            f"{name} (chunked attention, a bidirectional window or a custom mask), which "
            f"numflash cannot run yet: use attn_implementation='sdpa' for this model")
    causal = pattern[0]
    filled = int(q_offset) + q_length  # cache positions that hold keys (self-attention)
    if causal and kv_length > filled:  # (cross-attention, bidirectional, has its own kv_length)
        raise NotImplementedError(
            f"numflash's transformers attention got a key length of {kv_length} for {filled} "
            f"filled positions: a fixed-size (static) KV cache, whose unfilled slots and query "
            f"positions it cannot place yet; use the default dynamic cache")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise NotImplementedError(f"numflash's transformers attention takes a 2-D (batch, "
                                  f"kv_len) padding mask; got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _modifications(kwargs, causal):
    """numflash's options for the layer's ``sliding_window`` (W: query i sees keys i - W < j <=
    i, what transformers' sliding-window mask pattern says; flash-attn's window_size (W - 1, 0))
    and ``softcap`` (Gemma 2: cap tanh(score / cap) on the scaled score). The window comes
    from this keyword, as transformers' flash-attn path takes it: every model with sliding
    windows that runs on flash-attn passes it."""
    mods = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if not causal:
            raise NotImplementedError(f"numflash's transformers attention takes a sliding "
                                      f"window with causal attention only; this layer is "
                                      f"bidirectional with sliding_window={window}: use "
                                      f"attn_implementation='sdpa' for this model")
        mods["window_size"] = (int(window) - 1, 0)
    if kwargs.get("softcap"):
        mods["softcap"] = float(kwargs["softcap"])
    return mods


def _kept_keys(mask_row):
    """(start, end) of the one run of kept keys in a padding-mask row."""
    kept = torch.nonzero(mask_row).flatten()
    if kept.numel() == 0:
        return 0, 0
    start, end = int(kept[0]), int(kept[-1]) + 1
    if end - start != kept.numel():
        raise NotImplementedError("numflash's transformers attention takes padding at the ends "
                                  "of each sequence; this attention mask has holes inside one")
    return start, end


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention function: query (B, H, Nq, d), key and value (B, Hk, Nk, d),
    ``attention_mask`` what :func:`key_padding_mask` returned: a boolean key-padding mask, or
    integer sequence ids of packed rows (an integer 0 / 1 padding mask must come through
    :func:`key_padding_mask`, which makes it boolean). Returns ((B, Nq, H, d), weights), weights
    being the exact attention probabilities with ``output_attentions=True``, else None.
    ``dropout`` applies in training mode (numflash.dropout; seeds from torch's generator)."""
    dropout = dropout if module.training else 0.0
    if dropout and kwargs.get("output_attentions"):
        raise NotImplementedError("numflash's transformers attention gives the undropped "
                                  "probabilities only: with attention dropout in training, "
                                  "leave output_attentions off (or call model.eval())")
    if kwargs.get("s_aux") is not None:   # attention sinks (gpt-oss)
        raise NotImplementedError(f"numflash's transformers attention does not support "
                                  f"s_aux={kwargs['s_aux']!r} yet: use "
                                  f"attn_implementation='sdpa' for this model")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mods = _modifications(kwargs, causal)
    packed = attention_mask is not None and not attention_mask.dtype.is_floating_point and \
        attention_mask.dtype != torch.bool
    if packed or kwargs.get("cu_seq_lens_q") is not None:
        if kwargs.get("output_attentions"):
            raise NotImplementedError("numflash's transformers attention gives no attention "
                                      "probabilities for packed sequences (they have no dense "
                                      "form): leave output_attentions off")
        cu = _sequence_offsets(attention_mask) if packed else None
        return _packed_attention(query, key, value, causal, scaling, cu, kwargs,
                                 dropout_p=dropout, **mods), None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError("numflash's transformers attention got a dense attention mask: "
                                  "register it with numflash.transformers.register(), which also "
                                  "registers its mask function")
    nq, nk = query.shape[2], key.shape[2]  # key and value: Hk heads, read in place (GQA)
    # a lone new query sees every key, but for a window's, counted from the last key
    mode = "bottom_right" if causal and (nq > 1 or "window_size" in mods) else False
    if attention_mask is None:
        out, lse = _nt.attention(query, key, value, causal=mode, softmax_scale=scaling,
                                 return_lse=True, dropout_p=dropout, **mods)
        lse_parts = [(lse, key, 0, nk, 0, nq)]
    else:
        outs, lse_parts = [], []
        first = nk - nq  # self-attention: query row i is key position first + i
        for b in range(query.shape[0]):
            start, end = _kept_keys(attention_mask[b])
            if mode:  # causal: only the query rows at kept positions, [start, end)
                r0, r1 = max(0, start - first), max(0, min(nq, end - first))
            else:  # bidirectional (an encoder, cross-attention): every row sees the kept keys
                r0, r1 = 0, nq
            o = query.new_zeros(1, query.shape[1], nq, value.shape[3])
            lse = torch.full((1, query.shape[1], nq), float("-inf"), device=query.device,
                             dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
            kb, vb = key[b:b + 1, :, start:end], value[b:b + 1, :, start:end]
            if r1 > r0:
                rows_out, rows_lse = _nt.attention(query[b:b + 1, :, r0:r1], kb, vb, causal=mode,
                                                   softmax_scale=scaling, return_lse=True,
                                                   dropout_p=dropout, **mods)
                if r1 - r0 == nq:
                    o, lse = rows_out, rows_lse
                else:  # padding rows stay zero; torch.cat keeps the gradient path
                    o = torch.cat([o[:, :, :r0], rows_out, o[:, :, r1:]], dim=2)
                    lse = torch.cat([lse[:, :, :r0], rows_lse, lse[:, :, r1:]], dim=2)
            outs.append(o)
            lse_parts.append((lse, kb, start, end, r0, r1))
        out = torch.cat(outs)
    weights = None
    if kwargs.get("output_attentions"):
        weights = _probabilities(query, lse_parts, mode, scaling, nk, mods)
    return out.transpose(1, 2), weights


def _sequence_offsets(ids):
    """The packed sequences' cumulative lengths over the flattened (B x N) tokens: a sequence is a
    run of equal ids in one batch row."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([first, first.new_tensor([ids.numel()])]).to(torch.int32)


def _packed_attention(query, key, value, causal, scaling, cu, kwargs, **options):
    """Every packed sequence in one flash_attn_varlen_func call: query (B, H, N, d), key and
    value (B, Hk, N, .) flattened to (B N, heads, .); ``cu``: the offsets (else flash-attn's
    ``cu_seq_lens_q/k`` keyword arguments); ``options``: flash_attn_varlen_func's dropout_p,
    window_size and softcap. Returns (B, N, H, dv)."""
    B, H, nq = query.shape[:3]
    nk = key.shape[2]
    cu_q = cu if cu is not None else kwargs["cu_seq_lens_q"]
    cu_k = cu if cu is not None else kwargs.get("cu_seq_lens_k", cu_q)
    flat = [t.transpose(1, 2).reshape(B * n, t.shape[1], t.shape[3])
            for t, n in ((query, nq), (key, nk), (value, nk))]
    out = _nt.flash_attn_varlen_func(*flat, cu_q, cu_k, kwargs.get("max_length_q"),
                                     kwargs.get("max_length_k"), softmax_scale=scaling,
                                     causal=bool(causal), **options)
    return out.reshape(B, nq, H, value.shape[3])


def _probabilities(query, lse_parts, mode, scaling, nk, mods):
    """The (B, H, Nq, Nk) probabilities, zero on padding keys and padding query rows; each
    sequence's block comes from the same slice its attention ran on (the causal alignment)."""
    rows = []
    for b, (lse, keys, start, end, r0, r1) in enumerate(lse_parts):
        qb = query if len(lse_parts) == 1 else query[b:b + 1]
        p = qb.new_zeros(qb.shape[0], qb.shape[1], qb.shape[2], nk)
        if end > start and r1 > r0:
            p[:, :, r0:r1, start:end] = _nt.attention_probabilities(
                qb[:, :, r0:r1], keys, causal=mode, softmax_scale=scaling, **mods)
        rows.append(p)
    return torch.cat(rows)


def register(name=NAME):
    """Register numflash with transformers under ``name`` and return it, for
    ``attn_implementation=name``. The name must not contain "flash" (see the module's docstring)."""
    if "flash" in name:
        raise ValueError(f"transformers takes any attention name containing 'flash' for a "
                         f"flash-attn kernel; choose another name than {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, key_padding_mask)
    return name
