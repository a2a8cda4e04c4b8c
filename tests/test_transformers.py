"""numflash.transformers: a small random-initialized Llama-style model (built from a config, no
weights downloaded) run with numflash against the same model with transformers' "sdpa": logits,
a left-padded batch, greedy generation with the KV cache, output_attentions and a training step;
and the refusals that keep unsupported mask patterns from being dropped silently."""
import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="torch is optional: pip install torch==2.13.0")
transformers = pytest.importorskip("transformers", reason="transformers is optional")

import numflash  # noqa: E402
import numflash.transformers as ntf  # noqa: E402

NAME = ntf.register()


def llama(impl, dtype, kv_heads=2, seed=0, **extra):
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, max_position_embeddings=256,
                                   **{"attention_dropout": 0.0, **extra})
    torch.manual_seed(seed)
    # from_config keeps the config object: each model gets its own copy, or both would share
    # one attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation=impl, dtype=dtype)
    return model.eval()


def pair(dtype, kv_heads=2, **extra):
    ref = llama("sdpa", dtype, kv_heads, **extra)
    ours = llama(NAME, dtype, kv_heads, **extra)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == "sdpa"
    return ref, ours


def batch(n=70):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.long)
    mask[1, :9] = 0   # left padding
    mask[2, :40] = 0
    return ids, mask


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_logits_of_a_left_padded_batch_match_sdpa(dtype, tol, kv_heads):
    ref, ours = pair(dtype, kv_heads)
    ids, mask = batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        plain = ours(ids).logits
    kept = mask.bool()
    assert (got - want)[kept].abs().max().item() <= tol
    # the padding mask was applied: without it the padded rows' logits differ
    assert (plain - want)[1:][kept[1:]].abs().max().item() > 1e3 * tol


def test_greedy_generation_with_the_kv_cache_gives_the_same_tokens():
    ref, ours = pair(torch.float64)
    ids, mask = batch(24)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert got.shape == (3, 40) and torch.equal(got, want)


def test_greedy_generation_float32():
    """float32: the same tokens, or the first difference is a near-tie in sdpa's own logits."""
    ref, ours = pair(torch.float32)
    ids, mask = batch(24)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    for row in range(3):
        diff = (got[row, 24:] != want.sequences[row, 24:]).nonzero()
        if diff.numel():
            step = int(diff[0])
            top2 = want.logits[step][row].topk(2).values
            assert (top2[0] - top2[1]).item() < 1e-4, f"row {row} differs at step {step}"


def test_output_attentions_are_the_exact_probabilities():
    ref, ours = pair(torch.float64)
    eager = llama("eager", torch.float64)
    eager.load_state_dict(ref.state_dict())
    ids, mask = batch(33)
    with torch.no_grad():
        got_plain = ours(ids, output_attentions=True).attentions
        want_plain = eager(ids, output_attentions=True).attentions
        got = ours(ids, attention_mask=mask, output_attentions=True).attentions
        want = eager(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got_plain) == len(got) == 2
    for g, w in zip(got_plain, want_plain):  # eager takes its softmax in float32
        assert g.shape == w.shape == (3, 4, 33, 33)
        assert (g - w).abs().max().item() < 1e-6
    # Padded: eager's fully masked padding rows are NaN and poison its next layer, so only the
    # first layer compares; every layer's kept rows sum to 1 with nothing on padding keys.
    kept = mask.bool()
    rows = kept[:, None, :].expand(3, 4, 33)
    assert (got[0] - want[0])[rows].abs().max().item() < 1e-6
    for g in got:
        torch.testing.assert_close(g.sum(-1)[rows], torch.ones(int(rows.sum()), dtype=g.dtype))
        assert g.masked_select(~kept[:, None, None, :]).abs().max().item() == 0


def test_a_training_step_gives_the_same_parameter_gradients():
    ref, ours = pair(torch.float64)
    ref.train(), ours.train()
    ids, _ = batch(50)
    losses = []
    for model in (ref, ours):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-12
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_right_and_both_sided_padding_match_sdpa(dtype, tol):
    ref, ours = pair(dtype)
    eager = llama("eager", dtype)
    eager.load_state_dict(ref.state_dict())
    ids, mask = batch(40)
    mask = mask.flip(1)               # rows 1 and 2 padded on the right
    mask[0, :5], mask[0, -3:] = 0, 0  # row 0 on both sides
    kept = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask, output_attentions=True)
        probs = eager(ids, attention_mask=mask, output_attentions=True).attentions[0]
    assert (got.logits - want)[kept].abs().max().item() <= tol
    rows = kept[:, None, :].expand(3, 4, 40)
    assert (got.attentions[0] - probs)[rows].abs().max().item() < 1e-6


def packed(rows=((20, 30, 20), (70,))):
    """ids and position_ids of batch rows each packing sequences of these lengths."""
    g = torch.Generator().manual_seed(5)
    n = sum(rows[0])
    ids = torch.randint(0, 101, (len(rows), n), generator=g)
    positions = torch.stack([torch.cat([torch.arange(m) for m in row]) for row in rows])
    return ids, positions


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_packed_sequences_match_sdpa_and_each_sequence_alone(dtype, tol):
    """position_ids that restart pack several sequences in a row: transformers' packed pattern
    reaches numflash as sequence ids and every sequence runs in one varlen call; the logits
    match sdpa's (which builds the block-diagonal mask) and the first sequence run alone."""
    ref, ours = pair(dtype)
    ids, positions = packed()
    mask = ntf.key_padding_mask(2, 70, 70, mask_function=_packed_mask(positions))
    assert mask.dtype == torch.int64 and mask[0].unique().numel() == 3
    with torch.no_grad():   # (transformers finds packing only without a KV cache)
        want = ref(ids, position_ids=positions, use_cache=False).logits
        got = ours(ids, position_ids=positions, use_cache=False).logits
        alone = ours(ids[:1, 20:50]).logits
        whole = ours(ids).logits   # without the packing: the second sequence sees the first
    assert (got - want).abs().max().item() <= tol
    assert (got[0, 20:50] - alone[0]).abs().max().item() <= tol
    assert (whole[0, 20:50] - alone[0]).abs().max().item() > 1e3 * tol


def _packed_mask(positions):
    from transformers import masking_utils as mu
    seq = mu.find_packed_sequence_indices(positions)
    return mu.packed_sequence_compatibility_function(mu.causal_mask_function, positions, seq)


def _spy_packed(monkeypatch):
    """Record how each packed call got its offsets: "ids" (the mask function's sequence ids) or
    "kwargs" (cu_seq_lens_q/k)."""
    calls, real = [], ntf._packed_attention

    def spy(query, key, value, causal, scaling, cu, kwargs, **options):
        calls.append("kwargs" if cu is None else "ids")
        return real(query, key, value, causal, scaling, cu, kwargs, **options)
    monkeypatch.setattr(ntf, "_packed_attention", spy)
    return calls


def test_flash_kwargs_of_packed_sequences_and_a_training_step(monkeypatch):
    """DataCollatorWithFlattening's keyword arguments (cu_seq_lens_q/k, max_length_q/k) take the
    same one-call path (here with the KV cache on, so transformers does not find the packing
    itself); a training step on a packed row gives sdpa's gradients."""
    calls = _spy_packed(monkeypatch)
    ref, ours = pair(torch.float64)
    ids, positions = packed(((20, 30, 20),))
    cu = torch.tensor([0, 20, 50, 70], dtype=torch.int32)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30)
    with torch.no_grad():
        want = ref(ids, position_ids=positions, use_cache=False).logits
        got = ours(ids, position_ids=positions, **flash).logits
    assert calls == ["kwargs"] * 2   # both layers
    assert (got - want).abs().max().item() <= 1e-12
    ref.train(), ours.train()
    losses = []
    for model in (ref, ours):
        loss = model(ids, position_ids=positions, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert calls == ["kwargs"] * 2 + ["ids"] * 2
    assert abs(losses[0] - losses[1]) < 1e-12
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(NotImplementedError, match="no attention probabilities for packed"):
        ours(ids, position_ids=positions, use_cache=False, output_attentions=True)


def test_the_older_packed_pattern_and_other_compositions():
    """transformers before 5.2x composed packing as and_masks(causal, the ids' equality), with
    no remapped positions: taken too, and so is a packed sliding window (5.2x's form). Other
    compositions (the older form over a window, a causal mask and-ed with anything else) stay
    refused."""
    from transformers import masking_utils as mu
    _, positions = packed()
    seq = mu.find_packed_sequence_indices(positions)
    older = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(seq))
    assert torch.equal(ntf.key_padding_mask(2, 70, 70, mask_function=older), seq)
    window = mu.sliding_window_causal_mask_function(8)
    assert torch.equal(ntf.key_padding_mask(
        2, 70, 70, mask_function=mu.packed_sequence_compatibility_function(window, positions,
                                                                           seq)), seq)
    for pattern in (mu.and_masks(window, mu.packed_sequence_mask_function(seq)),
                    mu.and_masks(mu.causal_mask_function, window)):
        with pytest.raises(NotImplementedError, match="mask pattern"):
            ntf.key_padding_mask(2, 70, 70, mask_function=pattern)


def test_holes_inside_a_sequence_are_refused():
    _, ours = pair(torch.float64)
    ids, mask = batch(20)
    mask[0, 5] = 0
    with pytest.raises(NotImplementedError, match="holes inside one"):
        ours(ids, attention_mask=mask)


def windowed(arch, impl, dtype, window=8, seed=0, **extra):
    """A small random Mistral (every layer a sliding window) or Gemma 2 (sliding and full layers
    alternating, logits soft-capped in attention) from a config."""
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                  max_position_embeddings=256, attention_dropout=0.0)
    if arch == "mistral":
        cfg = transformers.MistralConfig(**common, **extra)
    else:
        cfg = transformers.Gemma2Config(**common, **{"head_dim": 16, "query_pre_attn_scalar": 16,
                                                     "attn_logit_softcapping": 2.0, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation=impl, dtype=dtype)
    return model.eval()


def windowed_pair(arch, dtype, **extra):
    # sdpa takes Mistral's window as a dense mask; Gemma 2's softcap runs in eager only
    ref = windowed(arch, "sdpa" if arch == "mistral" else "eager", dtype, **extra)
    ours = windowed(arch, NAME, dtype, **extra)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_and_softcap_models_match_transformers(arch):
    """A left-padded batch longer than the window: the logits match transformers' own, and a
    model without the window (and softcap) gives others, so both were applied."""
    ref, ours = windowed_pair(arch, torch.float64)
    ids, mask = batch(50)
    if arch == "gemma2":   # eager's rows of padding are NaN and reach every row a layer later
        mask = torch.ones_like(mask)
    plain = windowed(arch, NAME, torch.float64, window=None if arch == "mistral" else 4096,
                     **({} if arch == "mistral" else {"attn_logit_softcapping": None}))
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        other = plain(ids, attention_mask=mask).logits
    kept = mask.bool()
    # eager (Gemma 2's reference) takes its softmax in float32 even for a float64 model
    tol = 1e-12 if arch == "mistral" else 1e-5
    assert (got - want)[kept].abs().max().item() <= tol
    assert (other - want)[kept].abs().max().item() > 100 * tol


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_generation_with_the_kv_cache_gives_the_same_tokens(arch):
    ref, ours = windowed_pair(arch, torch.float64)
    ids, mask = batch(50)
    if arch == "gemma2":   # eager's padding rows are NaN (above): Mistral's test pads
        mask = torch.ones_like(mask)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert got.shape == (3, 62) and torch.equal(got, want)


@pytest.mark.extended   # (10 s; the README tier keeps Mistral's)
def test_gemma2_attentions_and_a_training_step_match_eager():
    """output_attentions carries the window and the softcap; parameter gradients of a step
    match eager's."""
    ref, ours = windowed_pair("gemma2", torch.float64)
    ids, _ = batch(20)
    with torch.no_grad():
        got = ours(ids, output_attentions=True).attentions
        want = ref(ids, output_attentions=True).attentions
    assert len(got) == 2
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-6   # eager takes its softmax in float32
    assert got[0][0, 0, 19, :12].abs().max().item() == 0   # outside the window of 8
    ref.train(), ours.train()
    for model in (ref, ours):
        model(ids, labels=ids).loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):   # float32 softmax
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_packed_sequences_with_a_sliding_window_match_sdpa():
    ref, ours = windowed_pair("mistral", torch.float64)
    ids, positions = packed()
    with torch.no_grad():
        want = ref(ids, position_ids=positions, use_cache=False).logits
        got = ours(ids, position_ids=positions, use_cache=False).logits
    assert (got - want).abs().max().item() <= 1e-12


def test_a_bidirectional_window_is_refused_not_run_without_it():
    from transformers import masking_utils as mu
    with pytest.raises(NotImplementedError, match="mask pattern"):
        ntf.key_padding_mask(1, 20, 20,
                             mask_function=mu.sliding_window_bidirectional_mask_function(8))
    q = torch.randn(1, 4, 20, 16, dtype=torch.float64)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="sliding window with causal"):
        ntf.attention_forward(module, q, q, q, None, is_causal=False, sliding_window=8)


def test_a_name_with_flash_in_it_is_refused():
    with pytest.raises(ValueError, match="flash"):
        ntf.register("numflash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_cuda_packed_sequences_run_in_one_launch_and_match_sdpa(dtype, tol, monkeypatch):
    """Packed rows on CUDA: one varlen call a layer (cuda.mma's one launch per pass), the logits
    within rounding of sdpa's, and a training step with finite gradients."""
    calls = _spy_packed(monkeypatch)
    ref, ours = (m.to("cuda") for m in pair(dtype, head_dim=64))
    ids, positions = (t.to("cuda") for t in packed())
    with torch.no_grad():
        want = ref(ids, position_ids=positions, use_cache=False).logits.float()
        got = ours(ids, position_ids=positions, use_cache=False).logits.float()
    assert calls == ["ids"] * 2
    assert (got - want).abs().max().item() <= tol
    ours.train()
    loss = ours(ids, position_ids=positions, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2),
                                        (torch.float32, 2e-4)])
def test_cuda_model_matches_sdpa(dtype, tol):
    _cuda_logits_and_a_training_step(*pair(dtype, head_dim=64), tol)  # test_torch's kernels


def _cuda_logits_and_a_training_step(ref, ours, tol):
    """On CUDA: a left-padded batch's logits within ``tol`` of the reference model's, and a
    training step of ours with a finite loss and finite gradients."""
    ref, ours = ref.to("cuda"), ours.to("cuda")
    ids, mask = (t.to("cuda") for t in batch())
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.float()
        got = ours(ids, attention_mask=mask).logits.float()
    assert (got - want)[mask.bool()].abs().max().item() <= tol
    ours.train()
    loss = ours(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.float32, 2e-4)])
def test_cuda_sliding_window_model_matches_sdpa(dtype, tol):
    """Mistral's window on CUDA (the tensor-core kernels' window, forward and backward)."""
    _cuda_logits_and_a_training_step(*windowed_pair("mistral", dtype, head_dim=64), tol)


def test_a_static_cache_is_refused_not_run_on_its_empty_slots():
    _, ours = pair(torch.float64)
    ids, _ = batch(6)
    cache = transformers.StaticCache(config=ours.config, max_cache_len=16)
    with pytest.raises(NotImplementedError, match="static"):
        ours(ids, past_key_values=cache)


def _drawn_seed(state):
    """The seed numflash.torch draws from torch's default generator after manual_seed(state)."""
    torch.manual_seed(state)
    return int(torch.randint(0, 2 ** 63 - 1, ()).item())


@pytest.mark.parametrize("padded", [False, True])
def test_attention_dropout_in_training_mode_only(padded):
    """A module in training mode with attention dropout: numflash drops with a seed from
    torch's generator, and the output is the reference's with that seed's mask (each padded
    batch entry is its own call, with its own seed); in eval mode nothing is dropped."""
    from numflash import testing
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.ones(2, 9, dtype=torch.bool) if padded else None
    if padded:
        mask[1, :3] = False
    module = type("Layer", (), {"training": True, "is_causal": True})()
    torch.manual_seed(8)
    out, _ = ntf.attention_forward(module, q, k, v, mask, dropout=0.4, scaling=0.3)
    seed = _drawn_seed(8)
    if not padded:
        want = numflash.reference.attention(*(t.numpy() for t in (q, k, v)), causal=True,
                                            softmax_scale=0.3, dropout_p=0.4, dropout_seed=seed)
        torch.testing.assert_close(out, torch.from_numpy(want).transpose(1, 2), rtol=0,
                                   atol=1e-13)
    else:   # entry 0 is the first call (the first seed drawn), over every key
        q0, k0, v0 = (t[:1].numpy() for t in (q, k, v))
        rep = testing.check(out[:1].transpose(1, 2).numpy(), q0, k0, v0, causal=True,
                            softmax_scale=0.3, dropout_p=0.4, dropout_seed=seed)
        assert rep.ok, rep
    module.training = False
    plain, _ = ntf.attention_forward(module, q, k, v, mask, dropout=0.4, scaling=0.3)
    module.training = True
    assert not torch.allclose(out, plain)
    with pytest.raises(NotImplementedError, match="undropped probabilities"):
        ntf.attention_forward(module, q, k, v, mask, dropout=0.4, output_attentions=True)


def test_a_model_trains_with_attention_dropout():
    """A model configured with attention_dropout trains with numflash: finite loss and
    gradients, reproducible under torch.manual_seed, different from the model without
    dropout; eval mode gives sdpa's logits."""
    ref, ours = pair(torch.float64, attention_dropout=0.2)
    ids, _ = batch(40)
    ours.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(3)
        losses.append(ours(ids, labels=ids).loss)
    assert losses[0].item() == losses[1].item() and math.isfinite(losses[0].item())
    losses[0].backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    ours.eval()
    plain = ours(ids, labels=ids).loss.item()
    assert plain != losses[0].item()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-9, atol=1e-11)


@pytest.mark.extended   # (6 s; the README tier keeps the padded dropout test)
def test_packed_rows_train_with_attention_dropout():
    """Packed sequences in training mode with attention dropout (each sequence its own mask):
    reproducible under torch.manual_seed, finite gradients, eval mode without dropout."""
    ref, ours = pair(torch.float64, attention_dropout=0.2)
    ids, positions = packed()
    ours.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(3)
        losses.append(ours(ids, position_ids=positions, labels=ids, use_cache=False).loss)
    assert losses[0].item() == losses[1].item() and math.isfinite(losses[0].item())
    losses[0].backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    ours.eval()
    with torch.no_grad():
        got = ours(ids, position_ids=positions, use_cache=False).logits
        want = ref(ids, position_ids=positions, use_cache=False).logits
    assert (got - want).abs().max().item() <= 1e-12
    ours.train()
    torch.manual_seed(3)
    dropped = ours(ids, position_ids=positions, use_cache=False).logits
    assert (dropped - want).abs().max().item() > 1e-3


def test_bidirectional_attention_with_padding_sees_every_kept_key():
    """An encoder or cross-attention (no causal mask, Nq != Nk): every query row attends to all
    kept keys, whatever side the padding is on."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    module = type("Encoder", (), {"training": False, "is_causal": False})()
    out, probs = ntf.attention_forward(module, q, k, v, mask, scaling=0.3, is_causal=False,
                                       output_attentions=True)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    p = torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), -1)
    torch.testing.assert_close(out, (p @ v.repeat_interleave(2, 1)).transpose(1, 2), rtol=0,
                               atol=1e-14)
    torch.testing.assert_close(probs, p, rtol=0, atol=1e-14)


def test_cross_attention_masks_are_not_taken_for_a_static_cache():
    """A bidirectional (cross-attention) mask has the encoder's key length, longer than the
    decoder's queries: only a causal mask with unfilled key slots is a static cache."""
    from transformers import masking_utils
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    got = ntf.key_padding_mask(2, 3, 6, mask_function=masking_utils.bidirectional_mask_function,
                               attention_mask=mask)
    assert torch.equal(got, mask)
    with pytest.raises(NotImplementedError, match="static"):
        ntf.key_padding_mask(2, 3, 6, mask_function=masking_utils.causal_mask_function,
                             attention_mask=mask)
