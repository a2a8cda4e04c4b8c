"""numflash.fingerprint: a user's modification function is named by what numba compiles from it.
The same code and values give the same fingerprint (in any process); any change numba would see
gives another; something the fingerprint cannot describe gives None (no disk cache)."""
import math
import subprocess
import sys
import textwrap

import numpy as np

from numflash.fingerprint import MAX_ARRAY_BYTES, fingerprint


def _make(source, **env):
    """A function ``f`` defined by exec (no source file: the fingerprint must not need one)."""
    namespace = {"math": math, "np": np, **env}
    exec(textwrap.dedent(source), namespace)  # noqa: S102 - test code
    return namespace["f"]


CAP = "def f(x, b, h, i, j):\n    return C * math.tanh(x / C)\n"


def test_the_same_code_and_values_give_the_same_fingerprint():
    one, two = _make(CAP, C=3.0), _make(CAP, C=3.0)
    assert one is not two and fingerprint(one) == fingerprint(two) is not None
    assert len(fingerprint(one)) == 64


def test_what_numba_freezes_changes_the_fingerprint():
    base = fingerprint(_make(CAP, C=3.0))
    changed = [
        _make(CAP, C=4.0),                                    # a global's value
        _make(CAP, C=3),                                      # its type
        _make(CAP.replace("tanh", "sinh"), C=3.0),            # the code
        _make(CAP.replace("x / C", "x / C + 1.0"), C=3.0),    # a constant
        _make(CAP.replace("j)", "j, k=1)"), C=3.0),           # the signature
        _make("def f(x, b, h, i, j, c=3.0):\n    return c * x\n"),
    ]
    prints = [fingerprint(f) for f in changed]
    assert None not in prints and base not in prints and len(set(prints)) == len(prints)
    with_default = "def f(x, b, h, i, j, c=3.0):\n    return c * x\n"
    assert fingerprint(_make(with_default)) != \
        fingerprint(_make(with_default.replace("c=3.0", "c=2.0")))  # a default


def test_called_functions_closures_and_arrays_are_followed():
    helper = "def g(x):\n    return x * T[1]\n"
    caller = "def f(x, b, h, i, j):\n    return g(x) + 1.0\n"

    def build(t):
        g = _make(helper.replace("def g", "def f"), T=t)
        return _make(caller, g=g)
    a, b = build(np.array([1.0, 2.0])), build(np.array([1.0, 2.5]))
    assert fingerprint(a) != fingerprint(b) and fingerprint(a) == fingerprint(
        build(np.array([1.0, 2.0])))

    def closure(scale):
        def f(x, b, h, i, j):
            return x * scale
        return f
    assert fingerprint(closure(2.0)) != fingerprint(closure(3.0))
    assert fingerprint(closure(2.0)) == fingerprint(closure(2.0))


def test_numba_dispatchers_and_recursion_are_fingerprinted():
    numba = __import__("numba")
    plain = _make(CAP, C=3.0)
    assert fingerprint(numba.njit(plain)) == fingerprint(plain)
    uses_jitted = _make("def f(x, b, h, i, j):\n    return g(x)\n",
                        g=numba.njit(_make(CAP, C=3.0)))
    assert fingerprint(uses_jitted) is not None
    recursive = _make("def f(n):\n    return 0 if n == 0 else f(n - 1)\n")
    assert fingerprint(recursive) is not None
    typed = _make("def f(x, b, h, i, j):\n    return float32(x) * np.float32(2)\n",
                  float32=numba.float32)
    assert fingerprint(typed) is not None


def test_what_it_cannot_describe_gives_none():
    class Settings:
        cap = 3.0
    assert fingerprint(_make("def f(x, b, h, i, j):\n    return s.cap * x\n", s=Settings())) \
        is None                                                         # a user's object
    assert fingerprint(_make("def f(x, b, h, i, j):\n    return m.C * x\n",
                             m=type(sys)("users_module"))) is None      # a user's module
    big = np.zeros(MAX_ARRAY_BYTES // 8 + 1)
    assert fingerprint(_make("def f(x, b, h, i, j):\n    return T[0] * x\n", T=big)) is None
    assert fingerprint(_make("def f(x, b, h, i, j):\n    return L.append\n", L=[])) is None
    assert fingerprint(len) is None and fingerprint("not a function") is None


def test_another_process_gives_the_same_fingerprint(tmp_path):
    module = tmp_path / "user_mods.py"
    module.write_text("import math\nC = 2.5\n"
                      "def helper(x):\n    return math.tanh(x / C)\n"
                      "def cap(x, b, h, i, j):\n    return C * helper(x)\n")
    script = ("import sys; sys.path.insert(0, %r)\n"
              "from numflash.fingerprint import fingerprint\n"
              "import user_mods\nprint(fingerprint(user_mods.cap))\n" % str(tmp_path))
    prints = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True).stdout.strip() for _ in range(2)}
    assert len(prints) == 1 and len(prints.pop()) == 64


def test_each_global_belongs_to_the_function_that_reads_it():
    """A review's case: the same values under the same names, read by different functions of
    a call chain (h(x) = x.real, g(x) = h(x) + real, f(x) = g(x).real) compile differently, so
    the fingerprints differ (a flat list of names and values made them equal)."""
    def chain(h_real, g_real, f_real):
        h = _make("def f(x):\n    return x.real\n", **({} if h_real is None else {"real": h_real}))
        g = _make("def f(x):\n    return h(x) + real\n", h=h, real=g_real)
        return _make("def f(x):\n    return g(x).real\n", g=g,
                     **({} if f_real is None else {"real": f_real}))
    assert fingerprint(chain(1.0, 2.0, None)) != fingerprint(chain(None, 1.0, 2.0))


def test_what_changes_numba_code_besides_the_bytecode():
    numba = __import__("numba")
    body = "def f(x):\n    return g(x)\n"
    callee = _make("def f(x):\n    return x / 3\n")
    plain = fingerprint(_make(body, g=numba.njit(callee)))
    assert plain != fingerprint(_make(body, g=numba.njit("float32(float32)")(callee)))
    assert plain != fingerprint(_make(body, g=numba.njit(error_model="numpy")(callee)))
    fields = [np.zeros(1, [("a", "f4"), ("b", "i4")]), np.zeros(1, [("a", "i4"), ("b", "f4")])]
    prints = {fingerprint(_make("def f(x):\n    return T[0].a\n", T=t)) for t in fields}
    assert len(prints) == 2 and None not in prints     # the same bytes, other fields
    raises = "def f(x):\n    try:\n        y = x\n        raise ValueError\n    except Exception:" \
             "\n        return -1.0\n    return y\n"
    in_else = "def f(x):\n    try:\n        y = x\n    except Exception:\n        return -1.0\n" \
              "    else:\n        raise ValueError\n    return y\n"
    assert fingerprint(_make(raises)) != fingerprint(_make(in_else))  # the exception table


def test_numba_objects_other_than_dispatchers_and_types_and_odd_values_give_none():
    numba = __import__("numba")
    ufunc = numba.vectorize(["float64(float64)"])(lambda x: x + 1.0)

    class Raises:
        def __getattr__(self, name):
            raise KeyError(name)
    for value in (ufunc, Raises(), 10 ** 5000, np.ma.masked_array([1.0]), [1.0]):
        assert fingerprint(_make("def f(x):\n    return x + V\n", V=value)) is None
