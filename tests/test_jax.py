"""numflash.jax: jax arrays in and out (in place through DLPack), gradients through
jax.custom_vjp with numflash's backward, jax.jit, jax.vmap, and checks before any tracing."""
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is optional: pip install jax")
import jax.numpy as jnp  # noqa: E402

import numflash  # noqa: E402
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


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_modifications_and_the_bias_gradient(rng, jit):
    """A window, softcap, ALiBi, a boolean mask and a (1, H, 1, Nk) bias: the output and the
    gradients of q, k, v and the bias (jax.grad with respect to it) within the rule."""
    q, k, v = arrays(rng, (2, 3, 21, 8), (2, 3, 26, 8), np.float64)
    do = jnp.asarray(rng.standard_normal((2, 3, 21, 8)))
    bias = jnp.asarray(rng.standard_normal((1, 3, 1, 26)))
    mask = jnp.asarray(rng.random((2, 1, 21, 26)) > 0.2)
    slopes = jnp.asarray([0.1, 0.2, 0.3])
    opts = dict(causal="bottom_right", window_size=(9, 2), softcap=5.0)

    def loss(q, k, v, bias):
        return (nj.attention(q, k, v, attn_bias=bias, attn_mask=mask, alibi_slopes=slopes,
                             **opts) * do).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    if jit:
        grad = jax.jit(grad)
    grads = [np.asarray(g) for g in grad(q, k, v, bias)]
    assert grads[3].shape == (1, 3, 1, 26)
    host = [np.asarray(a) for a in (q, k, v)]
    mods = dict(attn_bias=np.asarray(bias), attn_mask=np.asarray(mask),
                alibi_slopes=np.asarray(slopes), **opts)
    out = nj.attention(q, k, v, attn_bias=bias, attn_mask=mask, alibi_slopes=slopes, **opts)
    testing.assert_accurate(np.asarray(out), *host, **mods)
    rep = testing.assert_gradients_accurate(grads, np.asarray(do), *host, **mods)
    assert "dbias" in rep.errors


def test_dropout_with_an_int_seed_and_a_traced_one(rng):
    """Dropout's mask is numflash's for the same seed: an int eagerly, two uint32 words traced
    under jax.jit (a new seed is a new argument, not a recompile); its gradients meet the rule
    against the reference with the same mask."""
    q, k, v = arrays(rng, (1, 2, 17, 8), (1, 2, 23, 8), np.float64)
    host = [np.asarray(a) for a in (q, k, v)]
    seed = (7 << 32) | 12345
    want = numflash.attention(*host, causal=True, dropout_p=0.25, dropout_seed=seed)
    got = nj.attention(q, k, v, causal=True, dropout_p=0.25, dropout_seed=seed)
    np.testing.assert_array_equal(np.asarray(got), want)
    words = jnp.asarray([12345, 7], jnp.uint32)
    jitted = jax.jit(lambda q, k, v, s: nj.attention(q, k, v, causal=True, dropout_p=0.25,
                                                      dropout_seed=s))
    np.testing.assert_array_equal(np.asarray(jitted(q, k, v, words)), want)
    other = np.asarray(jitted(q, k, v, jnp.asarray([1, 0], jnp.uint32)))
    assert not np.array_equal(other, want)
    do = jnp.asarray(rng.standard_normal((1, 2, 17, 8)))
    grads = jax.grad(lambda q, k, v: (nj.attention(q, k, v, causal=True, dropout_p=0.25,
                                                   dropout_seed=seed) * do).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    testing.assert_gradients_accurate([np.asarray(g) for g in grads], np.asarray(do), *host,
                                      causal=True, dropout_p=0.25, dropout_seed=seed)


def test_bad_modification_and_dropout_arguments_are_refused(rng):
    q, k, v = arrays(rng, (1, 2, 5, 8), (1, 2, 5, 8), np.float32)
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        nj.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_seed must be an int"):
        nj.attention(q, k, v, dropout_p=0.1, dropout_seed=1.5)
    with pytest.raises(ValueError, match="attn_bias of shape"):
        nj.attention(q, k, v, attn_bias=jnp.zeros((3, 5)))
    with pytest.raises(TypeError, match="attn_mask must be a boolean"):
        nj.attention(q, k, v, attn_mask=jnp.zeros((5, 5)))
    with pytest.raises(TypeError, match=r"mod_args\[1\] must be a jax or NumPy array"):
        nj.attention(q, k, v, score_mod=_scattered, mod_args=(jnp.zeros(3), [1.0]))
    with pytest.raises(TypeError, match="mod_args must be a tuple"):
        nj.attention(q, k, v, score_mod=_scattered, mod_args=jnp.zeros(3))
    with pytest.raises(ValueError, match="score_mod_args_grad"):   # numflash's own check
        nj.attention(q, k, v, mask_mod=_scattered, mod_args=(jnp.zeros((2, 9)), 0, 0, 4),
                     score_mod_args_grad=(lambda *a: (0, 1.0), None, None, None))


def _scattered(b, h, i, j, table, slopes, temperature, shift):
    """A mask_mod reading the score_mod's arguments (they share mod_args)."""
    return (i + j + b) % 7 != 3 or table[h, i - j + shift] > 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_user_mods_and_their_mod_args_gradients(rng, jit):
    """A user's score_mod (test_mod_args_grad's relative-bias table, learned slopes and
    temperature, and a Python scalar) and a mask_mod reading the same mod_args:
    the output, and jax.grad with respect to q, k, v and each mod_args array, equal
    numflash.attention / attention_backward on the same NumPy arrays bit for bit (the same CPU
    kernels; tests/test_mod_args_grad.py holds those to the rule); the output within the rule
    of the reference; an array score_mod_args_grad does not name gets zeros."""
    from test_mod_args_grad import _arrays, _options
    Nq, Nk = 19, 23
    q, k, v, do = _arrays(rng, np.float32, Nq, Nk, d=8, Bn=2)
    opts = _options(rng, Nq, Nk, trained=(True, True, False), arg_dtype=np.float32)
    host = dict(opts, mask_mod=_scattered, causal="bottom_right")
    o, lse = numflash.attention(q, k, v, return_lse=True, **host)
    want = numflash.attention_backward(do, q, k, v, o, lse, return_mod_args_grad=True, **host)
    testing.assert_accurate(o, q, k, v, **host)

    table, slopes, temperature, shift = opts["mod_args"]

    def run(q, k, v, table, slopes, temperature):
        return nj.attention(q, k, v, causal="bottom_right", score_mod=opts["score_mod"],
                            score_mod_grad=opts["score_mod_grad"], mask_mod=_scattered,
                            mod_args=(table, slopes, temperature, shift),
                            score_mod_args_grad=opts["score_mod_args_grad"])

    def loss(*args):
        return (run(*args) * jnp.asarray(do)).sum()
    f, grad = run, jax.grad(loss, argnums=tuple(range(6)))
    if jit:
        f, grad = jax.jit(f), jax.jit(grad)
    args = [jnp.asarray(a) for a in (q, k, v, table, slopes, temperature)]
    np.testing.assert_array_equal(np.asarray(f(*args)), o)
    got = [np.asarray(g) for g in grad(*args)]
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[3], want[3][0])
    np.testing.assert_array_equal(got[4], want[3][1])
    assert want[3][2] is None and not got[5].any() and got[5].shape == temperature.shape


def _sliding_doc(b, h, i, j, docs):
    return docs[i] == docs[j] and i - 24 <= j <= i


@pytest.mark.extended   # (18 s, most of it the CPU kernel's compile with this mask_mod)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_block_mask_skips_its_empty_blocks_forward_and_backward(rng, jit):
    """A block mask (document ids and a window, 16 x 16 blocks, most of them EMPTY) from jax:
    the same output and gradients as numflash.attention with it on the NumPy arrays, within
    the rule of the reference with the same mask_mod."""
    N = 97
    docs = np.repeat(np.arange(4), [30, 20, 40, 7]).astype(np.int64)
    bm = numflash.create_block_mask(_sliding_doc, None, None, N, N, (docs,), block_size=16,
                                    device="cpu")
    q, k, v = (rng.standard_normal((2, 3, N, 16)) for _ in range(3))
    do = rng.standard_normal((2, 3, N, 16))
    o, lse = numflash.attention(q, k, v, block_mask=bm, return_lse=True)
    want = numflash.attention_backward(do, q, k, v, o, lse, block_mask=bm)
    testing.assert_accurate(o, q, k, v, mask_mod=_sliding_doc, mod_args=(docs,))

    def run(q, k, v):
        return nj.attention(q, k, v, block_mask=bm)

    def loss(q, k, v):
        return (run(q, k, v) * jnp.asarray(do)).sum()
    f, grad = run, jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        f, grad = jax.jit(f), jax.jit(grad)
    args = [jnp.asarray(a) for a in (q, k, v)]
    np.testing.assert_array_equal(np.asarray(f(*args)), o)
    for g, w in zip(grad(*args), want):
        np.testing.assert_array_equal(np.asarray(g), w)
    with pytest.raises(ValueError, match="block_mask"):   # made for other shapes: refused now
        nj.attention(*[a[:, :, :50] for a in args], block_mask=bm)
