"""Test setup: on a machine without a usable GPU, the CUDA kernels run in numba's simulator.

The switch must happen before numba.cuda is first imported, so it lives here.
"""
import os
import time


def _gpu_available():
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()
if not HAS_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


# Two tiers. The README's test command (setup.cfg: -m "not extended") runs every public function on
# the CPU and every CUDA kernel in the simulator or through its PTX at least once, in minutes on
# 2 cores; `pytest -m extended` (which .ci/run runs next) holds the long sweeps. Whole tests listed
# here are extended; for the sweeps listed, only the named cases stay in the fast tier.
EXTENDED_TESTS = {
    "test_every_variant_compiles_for_every_arch",    # every kernel x head dim x dtype x arch
    "test_default_configs_do_not_spill",
    "test_only_sm75_float64_at_d256_is_refused_and_says_why",
    "test_inspect_cli_check_passes",
    "test_block_configs_for_unequal_head_dims_do_not_spill",
    "test_backward_kernels_compile_without_spills",
    "test_torch_compile_inductor_fullgraph",         # inductor compiles C++ for ~20 s
    "test_hand_written_softcap_equals_the_builtin_forward_and_backward",  # 4 kernel compiles
    "test_prefix_lm_equals_its_explicit_mask",
    "test_user_relative_position_table_equals_the_expanded_bias",  # 23 s: compiles its own copies
    "test_ship_writes_portable_ptx_and_only_remakes_what_changed",  # maintainers' path, compiles
    "test_readme_modifications_example_runs",   # 22 s of CPU kernel compiles for its mods
    "test_row_variants_with_modifications_compile_for_turing_without_spills",  # 36 compiles
}
FAST_CASES = {  # sweep -> the case ids that stay in the fast tier
    # (float32-16-256-0-2, dv split in two column chunks: 22 s on 2 cores, extended)
    "test_row_kernel_large_head_dims": {"float32-200-40-0-1"},
    "test_tensor_core_word_kernel_emulated": {"f64-float64"},  # GQA; 3xtf32 emulates for 22 s
    # windows: every geometry in float64; 3xTF32 (7-11 s a case on 2 cores) on one (cp.async,
    # q held)
    "test_window_source_emulated_on_cpu": {
        f"{case}-f64" for case in ("both-sides-scalar", "left-bottom_right-cp.async",
                                   "left-causal-q-held", "right-only", "diagonal-only-empty-rows",
                                   "wider-than-keys")} | {"left-causal-q-held-3xtf32"},
    # modifications: every built-in together (all causal modes), key padding and a user mask in
    # the fast tier; each built-in alone in every causal mode is extended (each new combination
    # compiles its own CPU kernel copies: seconds per case on 2 cores)
    "test_each_builtin_forward_and_backward": {"all-False", "all-True", "all-bottom_right",
                                               "key-padding-True", "mask-bottom_right"},
    "test_builtins_combined_with_dtypes_layouts_gqa_and_odd_head_dims": {
        "float16-bhsd-False-59"},
    # non-finite inputs: every CPU case; in the simulator (8-34 s a case on 2 cores) float32 only
    "test_nan_scores_poison_exactly_the_rows_that_see_them": {
        f"{dt}-{w}-{c}-{b}" for w in "qk" for c in (False, True)
        for dt, b in (("float32", "cpu-auto"), ("float64", "cpu-auto"),
                      ("float32", "cuda-block"), ("float32", "cuda-row"))},
    "test_nan_scores_poison_the_gradients_as_in_the_reference": {"q-cpu", "k-cpu", "q-cuda"},
    "test_a_bad_value_reaches_exactly_the_rows_that_see_its_key": {
        f"{v}-{dt}-{b}" for v in ("nan", "inf") for dt, b in (
            [(dt, "cpu-auto") for dt in ("float16", "float32", "float64")]
            + [("float32", "cuda-block"), ("float32", "cuda-row")])},
    # torch entry points with modifications: each combination compiles its own CPU kernels
    "test_sdpa_attn_mask_matches_torch_with_gradients": {"4d-bool"},
    "test_flash_attn_func_window_softcap_alibi": {"softcap-alibi-causal"},
    # ring attention over gloo: every world size extended (97 s of start-up and compiles in
    # fresh processes); the README tier runs the README's 2-process ring example and the bad
    # input on 2 ranks (a run of its own, which compiles one small kernel)
    "test_ring_matches_one_call_on_the_whole_sequence": set(),
    # GQA on the CPU: each dtype, layout, causal mode and head grouping once in the fast tier
    # (the kernels compile per dtype and layout; 54 cases in all)
    "test_cpu_forward_and_backward_meet_the_accuracy_rule": {
        "bhsd-float16-False-H4-Hk2", "bhsd-float32-True-H6-Hk1",
        "bhsd-float64-bottom_right-H8-Hk4", "bshd-float32-bottom_right-H6-Hk1",
        "bshd-float16-True-H8-Hk4", "bshd-float64-False-H4-Hk2"},
    # modifications on packed sequences: every one together, and ALiBi per sequence, in the fast
    # tier; the rest (5 s a case on 2 cores: each combination compiles its CPU kernels) extended
    "test_modifications_apply_within_each_sequence": {"float64-bottom_right-all-shared-alibi",
                                                      "float32-False-alibi-per-sequence"},
    # (session 40: the README tier had grown to 13-14 min on 2 cores; these sweeps keep a case
    # of each kind and feature in it, the rest extended)
    # simulated backward: every dtype and causal mode at 1 x 1, and each dtype on both larger
    # shapes with the causal modes spread over them (3 s a case)
    "test_simulated_gradients_meet_the_accuracy_rule": {
        f"{dt}-1x1x1x1x1x1-{c}" for dt in ("float16", "float32", "float64")
        for c in ("False", "True", "bottom_right")} | {
        "float16-1x2x70x9x20x12-True", "float16-2x1x17x40x5x7-False",
        "float32-1x2x70x9x20x12-bottom_right", "float32-2x1x17x40x5x7-bottom_right",
        "float64-1x2x70x9x20x12-False", "float64-2x1x17x40x5x7-True"},
    # a user's mods on packed sequences, both causal modes; with built-ins beside them extended
    # (each combination compiles its CPU kernels: ~20 s; the built-ins per sequence are
    # test_modifications_apply_within_each_sequence's)
    "test_user_mods_see_the_sequence_index_and_positions_within_it": {"False-user",
                                                                      "bottom_right-user"},
    # wgmma compile checks: the d64 forward with every built-in but the window, with a window,
    # and with a document block mask and ALiBi; the backward with mods (d128 split: extended)
    "test_wgmma_with_modifications_compiles_without_spills_or_serialization": {
        "D64-DV64-NWG2-BC32-DTf16-document-block-mask-alibi",
        "D64-DV64-NWG2-BC64-DTf16-WINDOW1-", "D64-DV64-NWG2-BC32-DTf16-all-but-window"},
    "test_wgmma_backward_compiles_for_sm90a_without_spills_or_serialization": {
        "mods-f16-d64-alternate"},
    # the bias gradient in its shape: broadcast with a softcap, a user score_mod, float16 with
    # dropout (the full (B, H, Nq, Nk) float64 one: extended; each case compiles, ~8 s)
    "test_cpu_bias_gradient_meets_the_rule_in_the_bias_shape": {
        "float64-shape1-opts1", "float32-shape2-opts2", "float16-shape5-opts5"},
    # one-launch packed kernels emulated: with mods and dropout, and plain bottom-right
    "test_one_launch_kernels_emulated_equal_each_sequence_alone": {
        "f64-True-short-24-0-mods-0.25", "f64-bottom_right-short-24-0-None-0"},
    # the wgmma VARLEN forward emulated: with each sequence's own window (the other extended)
    "test_emulated_wgmma_forward_of_packed_sequences": {"64-False-tile2-window2"},
}


def _extended(item):
    name = item.originalname if hasattr(item, "originalname") else item.name
    if name in EXTENDED_TESTS:
        return True
    fast = FAST_CASES.get(name)
    return fast is not None and item.callspec.id not in fast


# .ci/run gives the extended tier a deadline, NUMFLASH_TEST_DEADLINE (seconds since the epoch), so
# that CI ends within its 90 minutes on a slow machine (a 2-core machine ran the same tests at half
# the speed of the day before, session 36): a test not started by then is skipped and says so, the
# summary counts them, and nothing started is cut short. The tier then runs its files' tests in
# turns, so a cut leaves every file tested.
_BUDGET_SPENT = "the tier's time budget (NUMFLASH_TEST_DEADLINE, .ci/run) was spent"


def _deadline():
    raw = os.environ.get("NUMFLASH_TEST_DEADLINE", "")
    try:
        return float(raw) if raw else None
    except ValueError:
        raise pytest.UsageError(f"NUMFLASH_TEST_DEADLINE={raw!r}: expected seconds since the "
                                "epoch, as `date +%s` prints") from None


def _in_turns(items):
    """The items reordered in turns over their files: each file's first test function (all its
    cases, which share their compiles), then each file's second, ... Ranks count within a tier
    (-m deselects later)."""
    ranks, file_order, keyed = {}, {}, []
    for position, item in enumerate(items):
        path = item.nodeid.split("::")[0]
        tier = (path, item.get_closest_marker("extended") is not None)
        functions = ranks.setdefault(tier, {})
        rank = functions.setdefault(getattr(item, "originalname", item.name), len(functions))
        keyed.append((rank, file_order.setdefault(path, len(file_order)), position, item))
    return [item for *_, item in sorted(keyed, key=lambda k: k[:3])]


_DEADLINE_KEY = pytest.StashKey()


def pytest_configure(config):
    config.stash[_DEADLINE_KEY] = _deadline()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    skip_sim = pytest.mark.skip(reason="simulator tests run on machines without a GPU")
    ids = {}
    for item in items:
        if getattr(item, "originalname", None) in FAST_CASES and hasattr(item, "callspec"):
            ids.setdefault(item.originalname, set()).add(item.callspec.id)
    for name, got in ids.items():  # a renamed case must not silently leave the fast tier
        if not config.option.keyword and FAST_CASES[name] - got:
            raise pytest.UsageError(f"tests/conftest.py FAST_CASES[{name!r}] names cases that "
                                    f"do not exist: {sorted(FAST_CASES[name] - got)}")
    for item in items:
        if _extended(item):
            item.add_marker(pytest.mark.extended)
        if item.get_closest_marker("gpu") and not HAS_GPU:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("simulator") and HAS_GPU:
            item.add_marker(skip_sim)
    if config.stash[_DEADLINE_KEY] is not None:
        items[:] = _in_turns(items)


def pytest_runtest_setup(item):
    deadline = item.config.stash[_DEADLINE_KEY]
    if deadline is not None and time.time() > deadline:
        pytest.skip(f"not started: {_BUDGET_SPENT}")


def pytest_terminal_summary(terminalreporter):
    unstarted = [r for r in terminalreporter.stats.get("skipped", [])
                 if isinstance(r.longrepr, tuple) and _BUDGET_SPENT in r.longrepr[2]]
    if unstarted:
        terminalreporter.write_line(f"{len(unstarted)} tests not started: {_BUDGET_SPENT}")


@pytest.hookimpl(optionalhook=True)   # xdist's hook: no error where xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    """The README tier hands out whole files (each file's CPU kernels then compile on one worker,
    not on both at once: 630 s cold on 2 cores with it and another change, 746 s before them,
    session 24); the extended tier, whose long tests crowd a few files, hands out tests one by
    one (xdist's default). An explicit --dist keeps its own."""
    from xdist.scheduler import LoadFileScheduling
    if config.getoption("dist") == "load" and config.option.markexpr == "not extended" \
            and "--dist" not in " ".join(config.invocation_params.args):
        return LoadFileScheduling(config, log)
    return None


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible per run."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
