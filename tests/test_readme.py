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
