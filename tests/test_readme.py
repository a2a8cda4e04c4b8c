"""The README's CPU example runs as written, and what it computes passes the accuracy rule (the GPU
example needs CuPy and a GPU)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_cpu_example_runs_and_is_accurate(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    cpu = next(b for b in blocks if "import cupy" not in b)
    ns = {}
    exec(compile(cpu, "README.md", "exec"), ns)
    testing = ns["testing"]
    opts = dict(causal="bottom_right")
    assert testing.check(ns["o"], ns["q"], ns["k"], ns["v"], lse=ns["lse"], **opts).ok
    assert testing.check_backward((ns["dq"], ns["dk"], ns["dv"]), ns["do"], ns["q"], ns["k"],
                                  ns["v"], **opts).ok
    assert "numflash backward plan: cpu.tiled" in capsys.readouterr().out


def _block(marker):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if marker in b)


def test_readme_torch_example_runs():
    import pytest
    torch = pytest.importorskip("torch")
    ns = {}
    exec(compile(_block("import torch, numflash"), "README.md", "exec"), ns)
    assert isinstance(ns["o"], torch.Tensor) and ns["q"].grad is not None
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().float() for t in (ns["q"], ns["k"], ns["v"])), is_causal=True)
    assert (ns["o"].detach().float() - ref).abs().max().item() < 2e-2


def test_readme_transformers_example_runs():
    import pytest
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ns = {}
    exec(compile(_block("numflash.transformers.register()"), "README.md", "exec"), ns)
    assert ns["model"].config._attn_implementation == "nf_attention"
    assert ns["tokens"].shape == (1, 11)


def test_readme_jax_example_runs():
    import numpy as np
    import pytest
    pytest.importorskip("jax")
    import numflash
    ns = {}
    exec(compile(_block("numflash.jax as nj"), "README.md", "exec"), ns)
    q, k, v = (np.asarray(ns[n]) for n in "qkv")
    ref = numflash.reference.attention(q, k, v)
    assert np.abs(np.asarray(ns["o"]) - ref).max() < 1e-5
    assert ns["g"].shape == q.shape
