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
    assert ns["g_bias"].shape == (1, 4, 1, 256)
    low, high = (int(w) for w in np.asarray(ns["seed"]))
    want = numflash.attention(q, k, v, dropout_p=0.1, dropout_seed=low | high << 32)
    assert np.abs(np.asarray(ns["od"]) - want).max() < 1e-5


_RING_SCRIPT = r'''
import os, sys, json
import torch, torch.multiprocessing as mp

def run(rank, world, init, block, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=init, RANK=str(rank),
                      WORLD_SIZE=str(world))
    g = torch.Generator().manual_seed(0)
    q_all, k_all, v_all, do_all = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))
    q_all, k_all, v_all = (t.requires_grad_() for t in (q_all, k_all, v_all))
    ns = dict(q_all=q_all, k_all=k_all, v_all=v_all, do_all=do_all)
    exec(compile(block.replace('"nccl"', '"gloo"'), "README.md", "exec"), ns)
    import numflash.torch as nt
    from numflash import distributed as nd
    whole = nt.attention(q_all.detach(), k_all.detach(), v_all.detach(), causal=True)
    want = nd.shard(whole, rank, world, seq_dim=2)
    err = float((ns["out"].detach() - want).abs().max())
    ok = q_all.grad is not None and ns["positions"].numel() == 8
    with open(out + str(rank), "w") as f:
        json.dump(dict(err=err, ok=ok), f)
    import torch.distributed as dist
    dist.destroy_process_group()

if __name__ == "__main__":
    block, out, port = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
    mp.spawn(run, args=(2, port, block, out), nprocs=2)
'''


def test_readme_ring_example_runs(tmp_path):
    """The ring attention example, on two CPU processes (gloo in place of nccl)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import pytest
    pytest.importorskip("torch")
    (tmp_path / "block.py").write_text(_block("nd.ring_attention"))
    (tmp_path / "run.py").write_text(_RING_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = str(README.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "block.py"),
                           str(tmp_path / "result"), port], capture_output=True, text=True,
                          timeout=300, env=env)
    for rank in range(2):
        path = tmp_path / f"result{rank}"
        assert path.exists(), proc.stderr[-3000:]
        r = json.loads(path.read_text())
        assert r["ok"] and r["err"] < 1e-5, r


def test_readme_modifications_example_runs():
    import numpy as np
    from numflash import testing
    ns = {}
    exec(compile(_block("score_mod=rel_bias"), "README.md", "exec"), ns)
    assert ns["dq"].shape == ns["q"].shape and np.isfinite(ns["dq"]).all()
    assert ns["dtable"].shape == ns["table"].shape and np.abs(ns["dtable"]).max() > 0
    q, k, v = ns["q"][:1], ns["k"][:1], ns["v"][:1]   # the last call: the document mask
    assert testing.check(ns["o"], q, k, v, causal=True, mask_mod=ns["doc_mask"],
                         mod_args=ns["args"]).ok


def test_readme_dropout_example_runs():
    from numflash import testing
    ns = {}
    exec(compile(_block("dropout_seed=1234"), "README.md", "exec"), ns)
    opts = dict(causal=True, dropout_p=0.1, dropout_seed=1234)
    assert testing.check(ns["o"], ns["q"], ns["k"], ns["v"], lse=ns["lse"], **opts).ok
    grads = (ns["dq"], ns["dk"], ns["dv"])
    assert testing.check_backward(grads, ns["o"] * 0 + 1, ns["q"], ns["k"], ns["v"], **opts).ok


def test_readme_kvcache_example_runs():
    """The decoding loop appends a row a step and attends to each sequence's rows."""
    import numpy as np
    from numflash import testing
    ns = {}
    exec(compile(_block("attention_with_kvcache(q, k_cache"), "README.md", "exec"), ns)
    assert list(ns["lengths"]) == [3, 13] and ns["out"].shape == (2, 1, 4, 16)
    np.testing.assert_array_equal(ns["k_cache"][[0, 1], ns["lengths"] - 1],
                                  ns["k_new"][:, 0])   # the last step's rows, where they belong
    for b, n in enumerate(ns["lengths"]):
        assert testing.check(ns["out"][b:b + 1], ns["q"][b:b + 1], ns["k_cache"][b:b + 1, :n],
                             ns["v_cache"][b:b + 1, :n], layout="bshd",
                             causal="bottom_right").ok
