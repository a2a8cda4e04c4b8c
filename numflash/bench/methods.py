"""The methods of a row: what a Method is, how --methods picks them, and numflash's own methods
(every algorithm that explain() accepts for the inputs, forward and backward)."""
import fnmatch
from dataclasses import dataclass, field

from .cases import blocks_from_config
from .failures import first_line


@dataclass
class Method:
    """One thing to time: ``call(i)`` runs it on input set i and returns its (B, H, Nq, dv) output."""
    name: str
    family: str                       # "numflash" or "peer"
    call: object
    io: str = None                    # "tiled" / "standard": which io_model prediction applies
    info: dict = field(default_factory=dict)
    memory: str = "pool"              # which peak-memory probe: "pool" (CuPy/NumPy) or "torch"
    refusal: object = None            # exc -> reason if the exception means "does not take these"
    check: object = None              # result -> check dict; default: sampled forward check


def selected(name, patterns):
    """Does a --methods pattern list pick this method? (exact name, prefix, or glob)."""
    if patterns is None:
        return True
    return any(name == p or name.startswith(p) or fnmatch.fnmatch(name, p) for p in patterns)



def numflash_methods(cfg, sets, backend_name, patterns, default_algorithms=None):
    """A Method per numflash algorithm that accepts the inputs, discovered through explain().

    Returns (methods, skipped) where skipped maps a method name to the reason it cannot run.
    """
    import numflash
    from numflash.plan import ALGORITHMS
    q, k, v = sets[0]
    algorithms = [a for a in ALGORITHMS if a != "auto"]
    if patterns is None and default_algorithms is not None:
        algorithms = list(default_algorithms)
    methods, skipped = [], {}
    for alg in algorithms:
        try:
            plan = numflash.explain(q, k, v, causal=cfg.causal, backend=backend_name,
                                    algorithm=alg)
        except ValueError as e:
            if alg != "auto":
                skipped[f"numflash-{alg}"] = f"refused: {first_line(e, 300)}"
            continue
        except Exception as e:  # noqa: BLE001 - a kernel module that fails to import
            skipped[f"numflash-{alg}"] = f"unavailable: {type(e).__name__}: {first_line(e)}"
            continue
        name = f"numflash-{plan.algorithm}"
        if not selected(name, patterns) or any(m.name == name for m in methods):
            continue

        def call(i, _alg=plan.algorithm):
            qi, ki, vi = sets[i]
            return numflash.attention(qi, ki, vi, causal=cfg.causal, backend=backend_name,
                                      algorithm=_alg)
        sram = getattr(plan.device, "smem_per_block_optin", None)
        methods.append(Method(name, "numflash", call, io="tiled",
                              info={"kernel": plan.kernel, "config": dict(plan.config),
                                    "blocks": blocks_from_config(plan.config),
                                    "sram_bytes": sram if backend_name == "cuda" else None}))
    return methods, skipped



def numflash_backward_methods(cfg, sets, dos, backend_name, patterns, check):
    """A Method per numflash algorithm whose backward explain() accepts: ``call(i)`` returns
    (dq, dk, dv) for output gradient dos[i]. The forward each backward needs (o and lse) is made
    here, outside the timing, so each timed call is the backward alone."""
    import numflash
    from numflash.plan import ALGORITHMS
    methods, skipped = [], {}
    for alg in [a for a in ALGORITHMS if a != "auto"]:
        name = f"numflash-{alg}"
        if not selected(name, patterns):
            continue
        try:
            plan = numflash.explain(*sets[0], causal=cfg.causal, backend=backend_name,
                                    algorithm=alg, backward=True)
        except ValueError as e:
            skipped[name] = f"refused: {first_line(e, 300)}"
            continue
        forwards = [numflash.attention(*s, causal=cfg.causal, backend=backend_name,
                                       return_lse=True) for s in sets]

        # deterministic=True where it plans another kernel (cuda.mma's two-pass dQ beside
        # its dQ adds): both are timed; a kernel that refuses it (cuda.wgmma) has one row
        try:
            repeatable = numflash.explain(*sets[0], causal=cfg.causal, backend=backend_name,
                                          algorithm=alg, backward=True, deterministic=True)
        except ValueError:
            repeatable = None
        variants = [(name, plan, False)]
        if repeatable is not None and dict(repeatable.config) != dict(plan.config):
            variants.append((f"{name}-deterministic", repeatable, True))
        for method_name, method_plan, deterministic in variants:
            if not selected(method_name, patterns):
                continue

            def call(i, _alg=alg, _fw=forwards, _det=deterministic):
                q, k, v = sets[i]
                return numflash.attention_backward(dos[i], q, k, v, *_fw[i], causal=cfg.causal,
                                                   backend=backend_name, algorithm=_alg,
                                                   deterministic=_det)
            methods.append(Method(method_name, "numflash", call, check=check,
                                  info={"kernel": method_plan.kernel,
                                        "config": dict(method_plan.config)}))
    return methods, skipped
