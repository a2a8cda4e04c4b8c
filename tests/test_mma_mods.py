"""Score and mask modifications on the tensor-core kernels (numflash/cuda/mma/mods.py): the
generated forward and backward source with mods run by the warp emulator on the CPU against the
float64 reference extended with the same mods, the MODS tokens and what may be cached, the
planner's choice and refusals, the variants compiled with no spill, and on a GPU at real sizes."""
import dataclasses

import numpy as np
import pytest

import numflash
from numflash import mods, testing
from numflash.inputs import parse_causal

from test_mma_backward import HOPPER, _kind_dtype, _mma_plan, _OnDevice, _plan, _problem
from test_mods import relative_bias, relative_bias_grad, tanh_cap, tanh_cap_grad


def _doc_ids(rng, B, N, docs=3):
    """(B, N) sorted document ids (packed sequences)."""
    return np.sort(rng.integers(0, docs, (B, N)), axis=1).astype(np.int32)


# mods by name: (B, H, Nq, Nk, rng) -> attention options
MODS = {
    "all-builtins": lambda B, H, Nq, Nk, rng: dict(
        window_size=(20, 3), softcap=5.0, alibi_slopes=rng.uniform(0.05, 0.5, H).astype(
            np.float32), attn_bias=rng.standard_normal((1, H, Nq, Nk)).astype(np.float32),
        attn_mask=rng.random((B, 1, Nq, Nk)) > 0.2),
    "all-but-window": lambda B, H, Nq, Nk, rng: dict(   # what cuda.wgmma takes
        softcap=5.0, alibi_slopes=rng.uniform(0.05, 0.5, H).astype(np.float32),
        attn_bias=rng.standard_normal((1, H, Nq, Nk)).astype(np.float32),
        attn_mask=rng.random((B, 1, Nq, Nk)) > 0.2),
    "sliding-window": lambda B, H, Nq, Nk, rng: dict(window_size=(200, 24)),
    "mask-softcap": lambda B, H, Nq, Nk, rng: dict(
        softcap=2.0, attn_mask=rng.random((B, H, Nq, Nk)) > 0.3),
    "key-padding-alibi-per-batch": lambda B, H, Nq, Nk, rng: dict(
        attn_mask=(np.arange(Nk)[None, None, None, :] <
                   np.array([Nk, Nk - 9])[:B, None, None, None]),
        alibi_slopes=rng.uniform(0.05, 0.5, (B, H))),
    # user functions: a document mask and a relative-position bias table read through mod_args
    "user-document-and-relative-bias": lambda B, H, Nq, Nk, rng: dict(
        mask_mod=mods._document_mask, score_mod=relative_bias, score_mod_grad=relative_bias_grad,
        mod_args=(rng.standard_normal((H, 2 * max(Nq, Nk) + 1)),)),
    # a block mask of documents (128 x 128 blocks), alone and with ALiBi
    "document-block-mask": lambda B, H, Nq, Nk, rng: dict(
        block_mask=_document_blocks(_doc_ids(rng, B, max(Nq, Nk)), B, H, Nq, Nk)),
    "document-block-mask-alibi": lambda B, H, Nq, Nk, rng: dict(
        block_mask=_document_blocks(_doc_ids(rng, B, max(Nq, Nk)), B, H, Nq, Nk),
        alibi_slopes=rng.uniform(0.05, 0.5, H).astype(np.float32)),
    "user-tanh-softcap-causal-window": lambda B, H, Nq, Nk, rng: dict(
        score_mod=tanh_cap, score_mod_grad=tanh_cap_grad, mod_args=(3.0,),
        window_size=(-1, 5)),
}


def _document_blocks(ids, B, H, Nq, Nk):
    mask_mod, args = mods.document_mask(ids[:, :Nq], ids[:, :Nk])
    return numflash.create_block_mask(mask_mod, B, H, Nq, Nk, args)


def _options(name, B, H, Nq, Nk, rng):
    opts = MODS[name](B, H, Nq, Nk, rng)
    if opts.get("mask_mod") is mods._document_mask:   # the document mask needs its ids: the
        ids = _doc_ids(rng, B, max(Nq, Nk))           # mask_mod's own arguments lead mod_args
        opts["mask_mod"] = _document_and_table
        opts["mod_args"] = (ids[:, :Nq], ids[:, :Nk]) + opts["mod_args"]
        opts["score_mod"] = _relative_bias_after_ids
        opts["score_mod_grad"] = _unit_after_ids
    return opts


# a mask_mod and a score_mod share mod_args: each reads the ones it needs
def _document_and_table(b, h, i, j, doc_q, doc_k, table):
    return doc_q[b, i] == doc_k[b, j]


def _relative_bias_after_ids(score, b, h, i, j, doc_q, doc_k, table):
    return score + table[h, i - j + table.shape[1] // 2]


def _unit_after_ids(score, b, h, i, j, doc_q, doc_k, table):
    return 1.0


def _emulated(DT, name, causal, fast=False):
    return pytest.param(DT, name, causal, id=f"{DT}-{name}-{causal}",
                        marks=() if fast else pytest.mark.extended)


def _inputs(rng, DT, B, H, Hkv, Nq, Nk, d):
    dtype = _kind_dtype(DT) if DT in ("f16", "bf16", "f64") else np.dtype(np.float32)
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    do = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    return q, k, v, do


@pytest.mark.parametrize("DT, name, causal", [
    _emulated("f16", "all-builtins", "bottom_right", fast=True),
    _emulated("f64", "user-document-and-relative-bias", True, fast=True),
    _emulated("bf16", "mask-softcap", False),
    _emulated("3xtf32", "key-padding-alibi-per-batch", True),
    _emulated("f64", "all-builtins", False),
    _emulated("f16", "user-tanh-softcap-causal-window", True),
])
def test_forward_with_mods_emulated_on_cpu(rng, DT, name, causal):
    """The forward's generated source with the mods compiled in (the scores modified after the
    bounds, the softmax then in log2(e) units): output and lse meet the accuracy rule against the
    reference with the same mods (float64 to 1e-12: the algebra exactly)."""
    from mma_tools import run_forward_kernel
    B, H, Nq, Nk, d = 2, 2, 40, 50, 32
    q, k, v, _ = _inputs(rng, DT, B, H, H, Nq, Nk, d)
    opts = _options(name, B, H, Nq, Nk, rng)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, **opts)
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=1, mods=built)
    rep = testing.check(out, q, k, v, lse=lse, causal=causal, **opts)
    assert rep.ok, rep
    if DT == "f64":
        want, want_lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True,
                                                      **opts)
        finite = np.isfinite(want_lse)
        assert np.abs(out - want).max() < 1e-12
        assert np.abs(lse[finite] - want_lse[finite]).max() < 1e-12
        assert (np.isneginf(lse) == np.isneginf(want_lse)).all()


@pytest.mark.parametrize("DT, name, causal, Hkv, tiles", [
    # extended: the README tier's 10 minutes on 2 cores; there the backward with mods is run by
    # test_rows_a_mask_empties_give_zeros_and_no_gradient_emulated (forward kernel -> backward)
    pytest.param("f16", "all-builtins", "bottom_right", 1, None, id="f16-all-builtins-gqa",
                 marks=pytest.mark.extended),
    pytest.param("f64", "user-document-and-relative-bias", True, 2, None,
                 id="f64-user-document-and-relative-bias", marks=pytest.mark.extended),
    pytest.param("bf16", "mask-softcap", False, 2, {"keys": (2, 64, 16)},
                 id="bf16-mask-softcap-sub-tiles", marks=pytest.mark.extended),
    pytest.param("f64", "user-tanh-softcap-causal-window", True, 1, None,
                 id="f64-user-tanh-softcap-window", marks=pytest.mark.extended),
    # float32's backward as 3xTF32, 8 queries a key-pass sub-tile (gradients.WORD_TILES' d128)
    pytest.param("3xtf32", "mask-softcap", "bottom_right", 1, {"keys": (2, 32, 8)},
                 id="3xtf32-mask-softcap-sub-tiles", marks=pytest.mark.extended),
])
def test_backward_with_mods_emulated_on_cpu(rng, DT, name, causal, Hkv, tiles):
    """Both backward passes with mods: dP first, then per score its modification and
    derivative, P and dS = P (dP - delta) times the derivative (the key pass keeps P^T for dV
    and dS^T in dP's registers); gradients meet the rule (float64: to 1e-12)."""
    from mma_tools import run_backward_kernels
    B, H, Nq, Nk, d = 2, 2, 33, 45, 32
    q, k, v, do = _inputs(rng, DT, B, H, Hkv, Nq, Nk, d)
    opts = _options(name, B, H, Nq, Nk, rng)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, **opts)
    o, lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True, **opts)
    lse_dtype = np.float64 if DT == "f64" else np.float32
    grads = run_backward_kernels(q, k, v, do, o.astype(q.dtype), lse.astype(lse_dtype), DT,
                                 is_causal, off, tiles=tiles, mods=built)
    rep = testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal, **opts)
    if DT == "f64":
        assert max(rep.errors.values()) < 1e-12, rep


def test_rows_a_mask_empties_give_zeros_and_no_gradient_emulated(rng):
    """A row whose every key a mask refuses: zeros, lse = -inf, and zero dQ (never NaN); the
    forward kernel's o and lse feed the backward kernels, whose gradients are exact."""
    from mma_tools import run_backward_kernels, run_forward_kernel
    B, H, Nq, Nk, d = 1, 1, 20, 20, 16
    q, k, v, do = _inputs(rng, "f64", B, H, H, Nq, Nk, d)
    mask = np.ones((B, H, Nq, Nk), bool)
    mask[0, 0, 5] = False
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", 0, attn_mask=mask)
    out, lse = run_forward_kernel(q, k, v, "f64", VEC=1, mods=built)
    assert (out[0, 0, 5] == 0).all() and np.isneginf(lse[0, 0, 5])
    assert np.isfinite(lse).sum() == Nq - 1
    # the backward reads the forward kernel's own o and lse (modified-score units)
    dq, dk, dv = run_backward_kernels(q, k, v, do, out, lse, "f64", mods=built)
    assert (dq[0, 0, 5] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    rep = testing.check_backward((dq, dk, dv), do, q, k, v, attn_mask=mask)
    assert max(rep.errors.values()) < 1e-12, rep


# ------------------------------------------------------------------------------- tokens

def test_tokens_name_the_functions_and_argument_types_and_leave_the_window_out():
    from numflash.cuda.mma import mods as kernel_mods
    shape = (2, 4, 16, 16, 8, 8)
    a = mods.build(shape, "numpy", 0, softcap=2.0, attn_bias=np.zeros((1, 4, 16, 16), np.float32))
    b = mods.build(shape, "numpy", 0, softcap=9.0, attn_bias=np.ones((1, 4, 16, 16), np.float32),
                   window_size=(3, 0))
    # values are run-time arguments: the same token, so the same compiled kernel
    assert kernel_mods.token_for(a) == kernel_mods.token_for(b) == \
        "score:softcap_score/softcap_grad[f,f]+score:bias_score/unit_grad[f4/4]"
    assert kernel_mods.arguments(b)[:2] == (9.0, 1 / 9.0) and len(kernel_mods.arguments(b)) == 3
    c = mods.build(shape, "numpy", 0, attn_bias=np.zeros((16,), np.float64))
    assert kernel_mods.token_for(c) == "score:bias_score/unit_grad[f8/4]"  # broadcast to 4-d
    assert kernel_mods.token_for(mods.build(shape, "numpy", 0, window_size=(3, 0))) == ""
    assert kernel_mods.token_for(None) == ""
    for built in (a, b, c):
        assert kernel_mods.cacheable(kernel_mods.token_for(built))


def test_a_user_function_is_named_by_its_fingerprint_and_cached_on_disk():
    from numflash.cuda import launch
    from numflash.cuda.mma import backward, forward, mods as kernel_mods
    from numflash.fingerprint import fingerprint
    shape = (1, 2, 8, 8, 8, 8)
    m = mods.build(shape, "numpy", 0, score_mod=tanh_cap, score_mod_grad=tanh_cap_grad,
                   mod_args=(2.0,))
    token = kernel_mods.token_for(m)
    assert token.startswith(f"score:tanh_cap~{fingerprint(tanh_cap)[:20]}/tanh_cap_grad~")
    assert token.endswith("[f]")
    again = mods.build(shape, "numpy", 0, score_mod=tanh_cap, score_mod_grad=tanh_cap_grad,
                       mod_args=(5,))
    assert kernel_mods.token_for(again) == token.replace("[f]", "[i]")  # same function, int
    assert kernel_mods.cacheable(token)
    cfg = dict(D=32, DV=32, NW=2, BC=32, HOLDQ=0, DT="f16", VEC=1, MODS=token)
    for factory in (forward.make_kernel, backward.make_query_kernel, backward.make_key_kernel):
        kernel = launch.Kernel("cuda.mma test", factory, cfg)
        assert kernel.cacheable and kernel.cache_key((), (9, 0))
    with pytest.raises(LookupError, match="no modifications registered"):
        kernel_mods.composition("score:never#99[f]")


class _Settings:  # an object of the user's: the fingerprint cannot vouch for what it holds
    cap = 3.0


_SETTINGS = _Settings()


def _opaque_cap(score, b, h, q_idx, kv_idx):
    return _SETTINGS.cap * score


def test_a_user_function_reading_an_object_gets_a_token_of_this_process_and_no_disk_cache():
    from numflash.cuda import launch
    from numflash.cuda.mma import backward, forward, mods as kernel_mods
    shape = (1, 2, 8, 8, 8, 8)
    token = kernel_mods.token_for(mods.build(shape, "numpy", 0, score_mod=_opaque_cap,
                                             score_mod_grad=tanh_cap_grad))
    assert token.startswith("score:opaque_cap#") and "/tanh_cap_grad~" in token
    assert not kernel_mods.cacheable(token)
    cfg = dict(D=32, DV=32, NW=2, BC=32, HOLDQ=0, DT="f16", VEC=1, MODS=token)
    for factory in (forward.make_kernel, backward.make_query_kernel, backward.make_key_kernel):
        kernel = launch.Kernel("cuda.mma test", factory, cfg)
        assert not kernel.cacheable and kernel.status((), (9, 0)) == "compile"
    builtin = kernel_mods.token_for(mods.build(shape, "numpy", 0, softcap=2.0))
    assert launch.Kernel("t", forward.make_kernel, dict(cfg, MODS=builtin)).cacheable


def test_a_user_mod_kernel_has_the_same_cache_key_in_another_process(tmp_path):
    """The point of the fingerprint: a second process finds the first one's cubin."""
    import subprocess
    import sys
    script = tmp_path / "key.py"
    script.write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "from numflash import mods\n"
        "from numflash.cuda import launch\n"
        "from numflash.cuda.mma import backward, mods as kernel_mods\n"
        "from test_mods import tanh_cap, tanh_cap_grad\n"
        "m = mods.build((1, 2, 8, 8, 8, 8), 'numpy', 0, score_mod=tanh_cap,\n"
        "               score_mod_grad=tanh_cap_grad, mod_args=(2.0,))\n"
        "cfg = dict(D=32, DV=32, NW=2, BC=32, HOLDQ=0, DT='f16', VEC=1,\n"
        "           MODS=kernel_mods.token_for(m))\n"
        "k = launch.Kernel('cuda.mma test', backward.make_key_kernel, cfg)\n"
        "print(k.cache_key((), (9, 0)))\n" % str(__import__("pathlib").Path(__file__).parent))
    keys = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(keys) == 1 and len(keys.pop()) == 32


def test_a_builtin_variant_identity_follows_the_mod_functions_source(monkeypatch):
    """A built-in's kernel is cached on disk under an identity that holds the functions'
    source: editing one (here: swapping the softcap's code) changes the key."""
    from numflash.cuda.mma import forward, mods as kernel_mods
    token = kernel_mods.token_for(mods.build((1, 1, 8, 8, 8, 8), "numpy", 0, softcap=2.0))
    cfg = dict(D=32, DV=32, NW=2, BC=32, HOLDQ=0, DT="f16", VEC=1, MODS=token)
    before = forward.code_identity(**cfg)
    assert before != forward.code_identity(**dict(cfg, MODS=""))
    monkeypatch.setattr(mods._softcap_score, "__code__", mods._softcap_grad.__code__)
    assert forward.code_identity(**cfg) != before


# ------------------------------------------------------------------------------- planning

def _with(p, **opts):
    built = mods.build(p.shape, "numpy", 0, **opts)
    p = _OnDevice(p)
    p.mods = built
    return p


def test_the_tensor_cores_take_every_modification_forward_and_backward(rng):
    p = _problem(rng, np.float16)
    opts = dict(softcap=3.0, attn_bias=np.zeros(p.shape[:4], np.float32), window_size=(8, 0),
                attn_mask=np.ones((p.shape[0], 1, 1, p.shape[3]), bool))
    plan = _mma_plan(_with(p, **opts), HOPPER)
    assert plan.kernel == "cuda.mma"
    assert _plan(_with(p, **opts), HOPPER).kernel == "cuda.wgmma"   # "auto" on Hopper
    assert all(c.WINDOW == 1 and c.MODS.startswith("mask:bool_mask[b1/4]+score:softcap_score")
               for c in plan.config.values())
    text = str(plan)
    assert "modifications: window_size=(8, 0), attn_mask, softcap=3, attn_bias" in text
    assert "device functions compiled into the kernel" in text


def test_forward_plan_with_mods_names_the_token(rng):
    from numflash.cuda import mma
    from numflash.inputs import normalize
    q = rng.standard_normal((1, 2, 64, 64)).astype(np.float16)
    p = normalize(q, q, q)
    p = dataclasses.replace(p, kind="cupy")
    p.mods = mods.build(p.shape, "numpy", 0, softcap=3.0)
    cfg = mma.config(_as_device(p), HOPPER)
    assert cfg.MODS == "score:softcap_score/softcap_grad[f,f]" and "MODS=" in str(cfg)


def test_the_plan_memo_tells_argument_types_apart(rng, monkeypatch):
    """The same function with a float and then an int argument: two kernels (the token holds
    the types), never the memoized plan of the other."""
    from numflash import plan as planner
    choose = planner._choose
    monkeypatch.setattr(planner, "_choose", lambda p, b, a, *rest: choose(p, b, a, HOPPER))
    from types import SimpleNamespace
    p = _problem(rng, np.float16)

    def on_gpu0(x):
        p = _with(p0, score_mod=tanh_cap, mod_args=(x,))
        p.q.device = SimpleNamespace(id=0)   # the memo keys on the arrays' GPU
        return p
    p0 = p
    plans = [planner.choose(on_gpu0(x), "cuda", "auto") for x in (2.0, 2, 3.0)]
    assert plans[0].config["queries"].MODS.endswith("[f]")
    assert plans[1].config["queries"].MODS.endswith("[i]")
    assert plans[2] is plans[0]   # values are run-time arguments: the memo serves them


def _as_device(p):
    from mma_tools import DeviceView
    return dataclasses.replace(p, **{n: DeviceView(getattr(p, n)) for n in ("q", "k", "v")})


def test_arrays_of_a_gpu_call_must_be_on_its_gpu_and_named():
    shape = (1, 2, 8, 8, 8, 8)
    with pytest.raises(TypeError, match="attn_bias is a host array .* q is on GPU 0: pass "
                                        "attn_bias as a CuPy array"):
        mods.build(shape, "cupy", 0, device_id=0, attn_bias=np.zeros((8, 8), np.float32))
    with pytest.raises(TypeError, match=r"alibi_slopes is a host array"):
        mods.build(shape, "cupy", 0, device_id=0, alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(TypeError, match=r"mod_args\[1\] is a host array"):
        mods.build(shape, "cupy", 0, device_id=0, score_mod=tanh_cap, mod_args=(2.0, np.ones(3)))
    with pytest.raises(TypeError, match=r"mod_args\[0\] is a list: on the GPU mod_args are CuPy "
                                        "arrays and int / float scalars"):
        mods.build(shape, "cupy", 0, device_id=0, score_mod=tanh_cap, mod_args=([1.0],))


# ------------------------------------------------------------------------------- compiling

def _compile(cases):
    """[(cc, direction, DT, d, window) -> (kernel, registers, spill bytes, stack, local ops)]
    for the planner's variants with every built-in but the window compiled in."""
    from test_cuda_compile import run_without_simulator
    out = run_without_simulator(f"""
        import dataclasses, json
        import numpy as np
        from numflash import mods
        from numflash.cuda import launch, mma
        from numflash.cuda.mma import gradients, mods as kernel_mods
        from numflash.device import Device
        SMEM = {{(9, 0): 227 * 1024, (8, 0): 163 * 1024}}
        rows = []
        for cc, direction, DT, d, window in {cases!r}:
            cc = tuple(cc)
            shape = (2, 4, 64, 64, d, d)
            opts = dict(softcap=30.0, alibi_slopes=np.ones(4, np.float32),
                        attn_bias=np.zeros((1, 4, 64, 64), np.float32),
                        attn_mask=np.ones((2, 1, 1, 64), bool))
            if window:
                opts["window_size"] = (16, 0)
            built = mods.build(shape, "numpy", 0, **opts)
            token = kernel_mods.token_for(built)
            if direction == "backward":
                cfg = {{k: dataclasses.replace(c, DT=DT, MODS=token) for k, c in
                       gradients.tiles(d, d, SMEM[cc], window, mods=True).items()}}
                kernels = gradients.compiled_kernels(cfg, "float16")
            else:
                tile = mma.choose_tile(d, d, DT, SMEM[cc], 1, cc, window, mods=True)
                form = ("m16n8k8" if cc >= (9, 0) else "m8n8k4") if DT == "f64" else None
                cfg = mma.MmaConfig(d, d, *tile, DT, 1, MMA=form, WINDOW=int(window),
                                    MODS=token)
                dtype = {{"f16": "float16", "bf16": "bfloat16", "3xtf32": "float32",
                         "f64": "float64"}}[DT]
                kernels = mma.compiled_kernels(cfg, dtype)
            for kernel, sig in kernels:
                cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)
                rows.append([list(cc), kernel.name, DT, d, window, res.get("registers", 0),
                             res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0),
                             res.get("stack_bytes", 0),
                             ptx.count("ld.local") + ptx.count("st.local"), len(cubin)])
        print(json.dumps(rows))
    """)
    import json
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("cases", [
    pytest.param([((9, 0), "forward", "f16", 64, False)], id="sm90-f16-d64",
                 marks=pytest.mark.extended),
    pytest.param([((9, 0), "backward", "f16", 64, False)], id="sm90-backward-d64",
                 marks=pytest.mark.extended),
    pytest.param([((9, 0), "forward", "f16", 128, True), ((9, 0), "forward", "3xtf32", 64, False),
                  ((9, 0), "forward", "3xtf32", 128, False), ((9, 0), "forward", "f64", 64, True),
                  ((8, 0), "forward", "3xtf32", 64, False)],
                 id="forward-kinds", marks=pytest.mark.extended),
])
def test_mods_variants_compile_with_no_spills(cases):
    """Every built-in compiled in (a 4-d bool mask, softcap, ALiBi, a 4-d bias): the tiles the
    planner picks with modifications fit in registers (no spill, stack or local memory)."""
    rows = _compile(cases)
    assert len(rows) >= len(cases)
    for cc, name, DT, d, window, regs, spills, stack, local, size in rows:
        assert 0 < regs <= 255 and size > 0, rows
        assert spills == stack == local == 0, rows


@pytest.mark.extended
def test_mods_variants_known_to_spill_stay_within_what_was_measured():
    """Where no spill-free tile was found (the d128 key pass, sm_80's 16-bit and float64
    forward: MODS_TILES' comments), ptxas' spill bytes stay at what the sweep measured
    (loads + stores, session 12), so a change that makes them worse is seen."""
    measured = {((8, 0), "cuda.mma", "f16", 64): 56, ((8, 0), "cuda.mma", "f16", 128): 80,
                ((8, 0), "cuda.mma", "f64", 64): 152,
                ((9, 0), "cuda.mma.backward_keys", "f16", 128): 208}
    rows = _compile([((8, 0), "forward", "f16", 64, False), ((8, 0), "forward", "f16", 128, False),
                     ((8, 0), "forward", "f64", 64, False), ((9, 0), "backward", "f16", 128,
                                                               False)])
    seen = {(tuple(cc), name, DT, d): spills for cc, name, DT, d, _, _, spills, *_ in rows}
    for key, bound in measured.items():
        assert seen[key] <= bound, (key, seen[key], bound)
    assert seen[((9, 0), "cuda.mma.backward_queries", "f16", 128)] == 0, seen


# ------------------------------------------------------------------------------- on a GPU

GPU_FORWARD = [  # (dtype, B, H, Hkv, Nq, Nk, d, causal, mods name)
    ("float16", 2, 8, 8, 1024, 1024, 64, True, "all-builtins"),
    ("bfloat16", 1, 8, 2, 777, 1025, 128, "bottom_right", "mask-softcap"),
    ("float32", 2, 4, 4, 513, 700, 64, False, "key-padding-alibi-per-batch"),
    ("float64", 1, 4, 4, 300, 257, 64, True, "all-builtins"),
    ("float16", 2, 4, 4, 600, 600, 128, True, "user-document-and-relative-bias"),
    ("float32", 1, 4, 4, 400, 400, 96, True, "user-tanh-softcap-causal-window"),
]


def _gpu_inputs(rng, dtype, B, H, Hkv, Nq, Nk, d, name):
    import cupy
    from numflash.block_mask import BlockMask
    dtype = _kind_dtype("bf16") if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in
                   ((B, H, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d), (B, H, Nq, d)))
    opts = _options(name, B, H, Nq, Nk, rng)

    def dev(x):
        if isinstance(x, BlockMask):   # the same mask on the GPU
            return BlockMask(x.mask_mod, tuple(dev(a) for a in x.mod_args), x.shape,
                             x.block_size, cupy.asarray(x.state))
        return cupy.asarray(x) if isinstance(x, np.ndarray) else x
    gpu_opts = {n: (tuple(dev(a) for a in x) if n == "mod_args" else dev(x))
                for n, x in opts.items()}
    return (q, k, v, do), tuple(cupy.asarray(a) for a in (q, k, v, do)), opts, gpu_opts


def check_gpu_forward_with_mods(rng, case, algorithm, sample_rows=None):
    """Run a GPU_FORWARD-style case on ``algorithm`` (explain must name that kernel with the
    modifications or window compiled in) and check output and lse against the reference with
    the same modifications (``sample_rows(Nq)``: the rows to check, None for all)."""
    dtype, B, H, Hkv, Nq, Nk, d, causal, name = case
    (q, k, v, _), (qg, kg, vg, _), opts, gpu_opts = _gpu_inputs(rng, dtype, B, H, Hkv, Nq, Nk,
                                                                  d, name)
    plan = numflash.explain(qg, kg, vg, causal=causal, algorithm=algorithm, **gpu_opts)
    assert plan.kernel == f"cuda.{algorithm}", str(plan)
    assert plan.config.MODS or plan.config.WINDOW, str(plan)
    o, lse = numflash.attention(qg, kg, vg, causal=causal, return_lse=True, algorithm=algorithm,
                                **gpu_opts)
    rep = testing.check(o.get(), q, k, v, lse=lse.get(), causal=causal,
                        rows=sample_rows(Nq) if sample_rows else None, **opts)
    assert rep.ok, rep


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_FORWARD, ids=lambda c: "-".join(map(str, c)))
def test_gpu_forward_with_mods_meets_the_rule(rng, case):
    check_gpu_forward_with_mods(rng, case, "mma")


GPU_BACKWARD = [  # (dtype, B, H, Hkv, Nq, Nk, d, causal, mods name)
    ("float16", 2, 8, 8, 1024, 1024, 64, True, "all-builtins"),
    ("bfloat16", 1, 8, 2, 777, 1025, 128, "bottom_right", "mask-softcap"),
    ("float16", 2, 4, 4, 600, 600, 128, True, "user-document-and-relative-bias"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_BACKWARD, ids=lambda c: "-".join(map(str, c)))
def test_gpu_backward_with_mods_meets_the_rule_and_repeats_bitwise(rng, case):
    dtype, B, H, Hkv, Nq, Nk, d, causal, name = case
    (q, k, v, do), (qg, kg, vg, dog), opts, gpu_opts = _gpu_inputs(rng, dtype, B, H, Hkv, Nq,
                                                                     Nk, d, name)
    # cuda.mma named: "auto" gives these to cuda.wgmma on Hopper (tests/test_wgmma_gpu.py)
    plan = numflash.explain(qg, kg, vg, causal=causal, backward=True, algorithm="mma",
                            **gpu_opts)
    assert plan.kernel == "cuda.mma", str(plan)
    o, lse = numflash.attention(qg, kg, vg, causal=causal, return_lse=True, **gpu_opts)
    # the default (dQ added atomically on sm_90) meets the rule; deterministic=True repeats
    grads = numflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal, algorithm="mma",
                                        **gpu_opts)
    testing.assert_gradients_accurate([g.get() for g in grads], do, q, k, v, causal=causal,
                                      **opts)
    runs = [numflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal,
                                        deterministic=True, **gpu_opts) for _ in range(2)]
    assert all(bool((a == b).all()) for a, b in zip(*runs))


_USER_MOD_PROCESS = """
import sys, time
sys.path.insert(0, {tests!r})
import cupy, numpy as np, numflash
from numflash import testing
from test_mods import tanh_cap
rng = np.random.default_rng(7)
q, k, v = (rng.standard_normal((1, 2, 200, 64)).astype(np.float16) for _ in range(3))
qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
opts = dict(causal=True, score_mod=tanh_cap, mod_args=(20.0,))
status = numflash.explain(qg, kg, vg, **opts).cache_status()   # before the first call
start = time.perf_counter()
o = numflash.attention(qg, kg, vg, **opts)
cupy.cuda.Device().synchronize()
print("first call", time.perf_counter() - start)
print("cache", status)
assert testing.check(o.get(), q, k, v, **opts).ok
np.save({out!r}, o.get())
"""


@pytest.mark.gpu
def test_gpu_a_user_mod_kernel_compiled_in_one_process_is_loaded_from_disk_by_another(tmp_path):
    """The fingerprint at work: a first process compiles the kernel with a user's score_mod
    (seconds to a minute), a second one with the same function finds it on disk."""
    import os
    import pathlib
    import subprocess
    import sys
    env = dict(os.environ, NUMFLASH_CACHE_DIR=str(tmp_path / "cache"), NUMFLASH_QUIET="1")
    runs = []
    for n in range(2):
        out = tmp_path / f"o{n}.npy"
        script = _USER_MOD_PROCESS.format(tests=str(pathlib.Path(__file__).parent),
                                          out=str(out))
        text = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, check=True).stdout
        lines = dict(line.split(" ", 1) if " " in line else (line, "")
                     for line in text.splitlines())
        runs.append((float(lines["first"].split()[-1]), lines["cache"], np.load(out)))
    (t0, cache0, o0), (t1, cache1, o1) = runs
    assert "compiles from source" in cache0 and "cached on disk" in cache1, (cache0, cache1)
    assert np.array_equal(o0, o1)
    print(f"first call: {t0:.2f} s compiling, {t1:.2f} s from disk")
    assert t1 < 5.0 and t1 < t0 / 3, (t0, t1)


@pytest.mark.gpu
def test_gpu_torch_sdpa_with_a_boolean_mask_runs_on_the_tensor_cores(rng):
    """numflash.torch.scaled_dot_product_attention with attn_mask on CUDA tensors: the mask is
    read in place by cuda.mma, forward and backward, and matches torch's own SDPA."""
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    B, H, N, d = 2, 4, 300, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g)
               .requires_grad_() for _ in range(3))
    mask = torch.rand(B, 1, N, N, device="cuda", generator=g) > 0.3
    got = nt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                            attn_mask=mask)
    assert (got.float() - want).abs().max().item() < 2e-2
    dO = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dO)
    want_grads = torch.autograd.grad(want, (q, k, v), dO.float())
    for a, b in zip(grads, want_grads):
        assert (a.float() - b).abs().max().item() < 5e-2
