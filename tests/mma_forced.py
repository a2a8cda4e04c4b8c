"""Run cuda.mma with a config other than the planner's (another GPU's tile or mma form, the
scalar staging path) on whatever GPU runs the tests, and check it against the reference."""
import pytest


def run_forced_config(q, k, v, causal, skip=None, **override):
    """mma.config for these inputs with ``override`` applied, run through mma.run; returns
    (config, AccuracyReport). Skips when ``skip(device)`` gives a reason, or when the config needs
    more shared memory than the device has."""
    from numflash import plan as planner
    from numflash.cuda import mma
    from numflash.inputs import normalize
    from numflash.testing import check
    p = normalize(q, k, v, causal=causal)
    dev = planner._cuda_device(p)
    why = skip(dev) if skip else None
    if why:
        pytest.skip(why)
    cfg = dict(mma.config(p, dev), **override)
    if mma.smem_bytes(cfg) > dev.smem_per_block_optin:
        pytest.skip(f"{cfg} needs more shared memory than {dev.name} has")
    lse = mma.run(p, cfg, dev)
    return cfg, check(p.out, q, k, v, lse=lse, causal=causal)
