"""The torch peers: torch SDPA with each of its backends (flash, efficient, cuDNN, math), forward
and backward, on the same inputs as numflash (torch sees them through DLPack, zero copy)."""
from .failures import clean_torch_warnings, first_line, is_oom
from .methods import Method, selected

TORCH_SDPA = (("torch-flash", "FLASH_ATTENTION"), ("torch-efficient", "EFFICIENT_ATTENTION"),
              ("torch-cudnn", "CUDNN_ATTENTION"), ("torch-math", "MATH"))


def try_torch():
    """(torch, None), or (None, why torch cannot be imported)."""
    try:
        import torch
        return torch, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {first_line(e)}"


def torch_sdpa_methods(torch, tsets, cfg, patterns):
    """torch SDPA with each backend, on torch tensors (already made from the inputs, zero copy)."""
    methods, skipped = [], {}
    wanted = [(n, a) for n, a in TORCH_SDPA if selected(n, patterns)]
    if not wanted:
        return methods, skipped
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
    except Exception as e:  # noqa: BLE001
        for n, _ in wanted:
            skipped[n] = f"unavailable: torch.nn.attention.sdpa_kernel: {first_line(e)}"
        return methods, skipped

    def refusal(exc):
        if isinstance(exc, RuntimeError) and not is_oom(exc):
            return f"refused: {first_line(exc)}"
        return None
    refusal.explain_warnings = clean_torch_warnings

    for name, attr in wanted:
        be = getattr(SDPBackend, attr, None)
        if be is None:
            skipped[name] = f"unavailable: SDPBackend.{attr} is not in torch {torch.__version__}"
            continue

        def call(i, _be=be):
            tq, tk, tv = tsets[i]
            with sdpa_kernel([_be]):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=cfg.causal,
                                                      scale=cfg.scale)
        methods.append(Method(name, "peer", call, io="standard" if attr == "MATH" else None,
                              memory="torch", refusal=refusal,
                              info={"sdpa_backend": attr}))
    return methods, skipped



def torch_sdpa_backward_methods(torch, cfg, sets, dos, patterns, check):
    """torch SDPA's backward per backend: ``call(i)`` is autograd.grad over a forward graph made
    here, outside the timing, for output gradient dos[i]; a backend that refuses the inputs (or
    runs out of memory) while the graphs are made is listed in skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    methods, skipped = [], {}
    for name, attr in TORCH_SDPA:
        if not selected(name, patterns) or getattr(SDPBackend, attr, None) is None:
            continue
        graphs = []
        try:
            for s, do in zip(sets, dos):
                t = [torch.from_dlpack(a).requires_grad_() for a in s]
                with sdpa_kernel([getattr(SDPBackend, attr)]):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *t, is_causal=cfg.causal, scale=cfg.scale)
                graphs.append((out, t, torch.from_dlpack(do)))
        except RuntimeError as e:
            skipped[name] = (f"OOM: {first_line(e)}" if is_oom(e) else
                             f"refused: {first_line(e)}")
            continue

        def call(i, _g=graphs):
            out, t, do = _g[i]
            return torch.autograd.grad(out, t, do, retain_graph=True)
        methods.append(Method(name, "peer", call, check=check, memory="torch",
                              info={"sdpa_backend": attr}))
    return methods, skipped
