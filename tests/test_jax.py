"""numflash.jax: jax arrays in and out (in place through DLPack), gradients through
jax.custom_vjp with numflash's backward, jax.jit, jax.vmap, and checks before any tracing."""
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is optional: pip install jax")
import jax.numpy as jnp  # noqa: E402

import numflash.jax as nj  # noqa: E402
from numflash import testing  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 arrays; float32 stays float32


def arrays(rng, shape_q, shape_kv, dtype, dv=None):
    shape_v = shape_kv[:-1] + (dv or shape_kv[-1],)
    return [jnp.asarray(rng.standard_normal(s).astype(dtype)) for s in (shape_q, shape_kv, shape_v)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_and_grad_meet_the_accuracy_rule(rng, dtype, causal, jit):
    q, k, v = arrays(rng, (2, 3, 37, 16), (2, 3, 53, 16), dtype, dv=24)
    do = jnp.asarray(rng.standard_normal((2, 3, 37, 24)).astype(dtype))

    def f(q, k, v):
        return nj.attention(q, k, v, causal=causal, return_lse=True)

    def loss(q, k, v):  # d loss / d out = do
        return (nj.attention(q, k, v, causal=causal) * do).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        f, grad = jax.jit(f), jax.jit(grad)
    out, lse = f(q, k, v)
    assert isinstance(out, jax.Array) and out.dtype == dtype and out.shape == (2, 3, 37, 24)
    host = [np.asarray(a) for a in (q, k, v)]
    testing.assert_accurate(np.asarray(out), *host, lse=np.asarray(lse), causal=causal)
    testing.assert_gradients_accurate([np.asarray(g) for g in grad(q, k, v)], np.asarray(do),
                                      *host, causal=causal)


def test_bshd_layout_and_vmap(rng):
    q, k, v = arrays(rng, (3, 2, 11, 4, 8), (3, 2, 9, 4, 8), np.float64)
    got = jax.vmap(lambda q, k, v: nj.attention(q, k, v, layout="bshd"))(q, k, v)
    for i in range(3):
        testing.assert_accurate(np.asarray(got[i]), *(np.asarray(a[i]) for a in (q, k, v)),
                                layout="bshd")


def test_eager_inputs_are_read_in_place():
    """np.from_dlpack of a CPU jax array is a view of its buffer: numflash reads it there."""
    x = jnp.ones((1, 1, 4, 4))
    assert np.from_dlpack(x).ctypes.data == x.unsafe_buffer_pointer()


def test_bad_inputs_are_refused_before_tracing(rng):
    q, k, v = arrays(rng, (1, 2, 5, 8), (1, 2, 5, 8), np.float32)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        jax.jit(lambda q: nj.attention(q, k, v, softmax_scale=float("nan")))(q)
    with pytest.raises(ValueError, match="q and k must have the same head dim"):
        nj.attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="k must be 4-D"):
        jax.jit(lambda k: nj.attention(q, k, v))(k[0])
    with pytest.raises(ValueError, match="not bfloat16"):
        nj.attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    with pytest.raises(TypeError, match="k must be a jax array"):
        nj.attention(q, [1, 2], v)
