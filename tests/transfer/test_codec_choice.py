"""The per-transfer codec chooser: least predicted encode + wire + decode wins, links and policy steer
it, exploration is bounded, and measurements move the estimates."""

from __future__ import annotations

import pytest
import torch

from transfer.codec import Compression, KVLayout
from transfer.codec_choice import (
    ALL_CODECS, LINK_PRIORS, ChooserConfig, LinkPrior, CodecChooser, LossyCodecForExactTenant, allowed_codecs, link_class,
)
from transfer.codec_cost import CodecCost, LineFit, calibrate

NONE, INT8, FP8, ZSTD = Compression.NONE, Compression.INT8, Compression.FP8, Compression.ZSTD
MB = 1_000_000
LAYOUT = KVLayout("tiny", num_layers=4, num_kv_heads=2, head_dim=16, block_size=4)


def costs(encode_per_mb: dict[Compression, float], ratio: dict[Compression, float],
          fixed_s: dict[Compression, float] | None = None) -> dict[Compression, CodecCost]:
    """Codec lines: `fixed_s[c]` (default 0) plus `encode_per_mb[c]` seconds per MB to encode, as much to decode."""
    out = {}
    for c in ALL_CODECS:
        cost = CodecCost(c)
        fixed = (fixed_s or {}).get(c, 0.0)
        for raw in (MB, 4 * MB):
            cost.encode.add(raw, fixed + encode_per_mb[c] * raw / MB)
            cost.decode.add(raw, fixed + encode_per_mb[c] * raw / MB)
        cost.wire_ratio = ratio[c]
        out[c] = cost
    return out


# Codec costs per MB each way: none copies (0.1 ms), int8 and fp8 quantize (0.3 and 0.25 ms)
# and shrink the bytes to 0.27x and 0.25x; zstd (lossless) takes 2 ms and ships 0.7x.
CPU = {NONE: 0.0001, INT8: 0.0003, FP8: 0.00025, ZSTD: 0.002}
RATIO = {NONE: 1.0, INT8: 0.27, FP8: 0.25, ZSTD: 0.7}


def quiet(**kw: object) -> ChooserConfig:
    return ChooserConfig(explore_every=kw.pop("explore_every", 1000), **kw)  # type: ignore[arg-type]


def feed_wire(chooser: CodecChooser, peer: str, bytes_per_s: float, overhead_s: float = 0.0) -> None:
    """Sends of every codec (so none is left to explore) at a few sizes over a wire of `bytes_per_s`."""
    for raw in (2 * MB, 8 * MB, 32 * MB):
        for c in ALL_CODECS:
            wire = int(RATIO[c] * raw)
            chooser.record(peer, c, raw, wire, CPU[c] * raw / MB, overhead_s + wire / bytes_per_s)


def test_the_least_predicted_codec_wins_and_predictions_add_up() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), quiet(), default_link="cross_node")
    raw = 40 * MB
    choice = chooser.choose("d0", raw)
    prior = LINK_PRIORS["cross_node"]
    expect = {c.name.lower(): 2 * CPU[c] * raw / MB + prior.overhead_s + RATIO[c] * raw / prior.bandwidth_bytes_per_s
              for c in ALL_CODECS}
    assert choice.predicted_s == pytest.approx(expect)
    assert choice.codec == min(ALL_CODECS, key=lambda c: expect[c.name.lower()])
    assert choice.reason == "predicted" and choice.link == "cross_node"
    assert choice.chosen_predicted_s == pytest.approx(min(expect.values()))


def test_a_slow_link_favours_compression_and_a_fast_one_none() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), quiet())
    # 0.5 GB/s: 1 MB of none is 2 ms on the wire; fp8 saves 1.5 of them for 0.3 ms more codec
    feed_wire(chooser, "slow", 0.5e9)
    feed_wire(chooser, "fast", 20e9)
    assert chooser.choose("slow", 50 * MB).codec == FP8
    assert chooser.choose("fast", 50 * MB).codec == NONE
    assert chooser.estimate("slow").bandwidth_bytes_per_s == pytest.approx(0.5e9, rel=1e-6)
    assert chooser.estimate("fast").num_sends == 12


def test_the_choice_switches_when_the_measured_bandwidth_changes() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), quiet(decay=0.5))
    feed_wire(chooser, "d", 20e9)
    assert chooser.choose("d", 50 * MB).codec == NONE
    for _ in range(4):  # the link slows down (another tenant's traffic): recent sends dominate
        feed_wire(chooser, "d", 0.3e9)
    assert chooser.choose("d", 50 * MB).codec == FP8
    for _ in range(4):
        feed_wire(chooser, "d", 20e9)
    assert chooser.choose("d", 50 * MB).codec == NONE


TIE = {NONE: 1e-4, INT8: 1e-3, FP8: 1e-4, ZSTD: 1e-2}
TIE_RATIO = {NONE: 1.0, INT8: 0.27, FP8: 0.97, ZSTD: 0.7}


def test_a_near_tie_stays_exact() -> None:
    # fp8 predicted 3% faster than none: within the margin, none; 10% faster: fp8
    chooser = CodecChooser(costs(TIE, TIE_RATIO), quiet())
    chooser.set_link("d", "process")
    choice = chooser.choose("d", 100 * MB)
    assert choice.predicted_s["fp8"] < choice.predicted_s["none"] < 1.05 * choice.predicted_s["fp8"]
    assert choice.codec == NONE and choice.reason == "predicted"
    lax = CodecChooser(costs(TIE, TIE_RATIO),
                       quiet(lossy_min_gain_ratio=0.0, lossy_min_gain_s=0.0))
    lax.set_link("d", "process")
    assert lax.choose("d", 100 * MB).codec == FP8


def test_link_priors_decide_before_any_send() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), quiet(), default_link="cross_node")
    chooser.set_link("same-process", "process")
    assert chooser.choose("same-process", 50 * MB).codec == NONE  # 8 GB/s: quantizing costs more than it saves
    assert chooser.choose("far", 50 * MB).codec == FP8  # 1.25 GB/s
    with pytest.raises(ValueError, match="unknown link class"):
        chooser.set_link("x", "moon")  # type: ignore[arg-type]


def test_link_class_of_a_peer() -> None:
    assert link_class("local", "h1", None) == "process"
    assert link_class("cuda_ipc", "h1", None) == "node"
    assert link_class("nixl", "h1", "h1") == "node"
    assert link_class("nixl", "h1", "h2") == "cross_node"
    assert link_class("object_store", "h1", None) == "cross_node"  # unknown node: the conservative prior


def test_policy_limits_the_codecs() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), ChooserConfig(explore_every=2))
    feed_wire(chooser, "slow", 0.3e9)
    exact = [chooser.choose("slow", 50 * MB, allowed_codecs("none")) for _ in range(10)]
    assert {c.codec for c in exact} == {NONE} and {c.reason for c in exact} == {"forced"}
    assert set(exact[0].predicted_s) == {"none"}
    lossy = chooser.choose("slow", 50 * MB, (NONE, INT8))
    assert lossy.codec == INT8 and set(lossy.predicted_s) == {"none", "int8"}
    # exact, the default fidelity: auto means the lossless codecs; a lossy one must be opted into
    assert allowed_codecs("auto") == (NONE, ZSTD) and allowed_codecs("zstd") == (ZSTD,)
    assert allowed_codecs("auto", "lossy") == ALL_CODECS and allowed_codecs("fp8", "lossy") == (FP8,)
    with pytest.raises(LossyCodecForExactTenant, match="kv_fidelity: lossy"):
        allowed_codecs("fp8")
    with pytest.raises(ValueError, match="unknown KV fidelity"):
        allowed_codecs("auto", "approximate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auto, none, int8, fp8, zstd"):
        allowed_codecs("brotli")
    with pytest.raises(ValueError, match="no codec allowed"):
        chooser.choose("slow", MB, ())


def test_exploration_tries_untried_codecs_early_then_stays_bounded() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), ChooserConfig(explore_every=4, explore_max_ratio=1.5))
    chooser.set_link("d", "process")
    reasons, codecs = [], []
    for _ in range(24):
        choice = chooser.choose("d", 20 * MB)
        reasons.append(choice.reason)
        codecs.append(choice.codec)
        wire = int(RATIO[choice.codec] * 20 * MB)
        chooser.record("d", choice.codec, 20 * MB, wire, CPU[choice.codec] * 20, wire / 8e9)
    explored = [i for i, r in enumerate(reasons) if r == "explore"]
    # The never-tried codecs every other transfer (in codec order); after that nothing, since all
    # are predicted over 1.5x the best (none) and have been tried.
    assert explored == [1, 3, 5]
    assert [codecs[i] for i in explored] == [INT8, FP8, ZSTD]
    assert all(codecs[i] == NONE for i in range(24) if i not in explored)
    assert chooser.estimate("d").tries == {"none": 21, "int8": 1, "fp8": 1, "zstd": 1}


def test_only_transfers_no_larger_than_the_typical_one_explore() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), ChooserConfig(explore_every=2, explore_min_s=0.0))
    chooser.set_link("d", "process")
    sizes = [10 * MB, 40 * MB, 40 * MB, 2 * MB, 40 * MB, 1 * MB]
    picks = [chooser.choose("d", size) for size in sizes]
    # the 2nd and 3rd are due to explore but larger than the typical transfer; the 4th explores
    assert [p.reason for p in picks] == ["predicted", "predicted", "predicted", "explore", "predicted", "explore"]


def test_tiny_transfers_never_explore() -> None:
    chooser = CodecChooser(costs(CPU, RATIO, {NONE: 1e-5, INT8: 2e-4, FP8: 1e-4}), ChooserConfig(explore_every=2))
    chooser.set_link("d", "node")
    for _ in range(6):  # a Ray call's 5 ms per send, whatever the size: it is not the codecs' to save
        chooser.record("d", NONE, 30_000, 30_000, 1e-5, 0.005)
    picks = [chooser.choose("d", 30_000) for _ in range(10)]
    assert {(p.codec, p.reason) for p in picks} == {(NONE, "predicted")}
    assert chooser.choose("d", 5 * MB).reason == "predicted"  # larger than the typical transfer
    assert chooser.choose("d", 1 * MB).reason == "predicted"  # 1 MB: still under 5 ms of size-dependent work
    eager = CodecChooser(costs(CPU, RATIO, {NONE: 1e-5, INT8: 2e-4, FP8: 1e-4}),
                         ChooserConfig(explore_every=2, explore_min_s=0.0))
    eager.set_link("d", "node")
    for _ in range(6):
        eager.record("d", NONE, 30_000, 30_000, 1e-5, 0.005)
    assert [eager.choose("d", 30_000).reason for _ in range(3)] == ["predicted", "explore", "predicted"]


def test_exploration_revisits_a_close_runner_up() -> None:
    near = {NONE: 0.001, INT8: 0.0012, FP8: 0.0012, ZSTD: 0.01}
    chooser = CodecChooser(costs(near, {NONE: 1.0, INT8: 0.9, FP8: 0.9, ZSTD: 0.7}), ChooserConfig(explore_every=3))
    chooser.set_link("d", "process")
    picks = []
    for _ in range(12):
        picks.append(chooser.choose("d", 10 * MB, (NONE, INT8, FP8)))
        chooser.record("d", picks[-1].codec, 10 * MB, 10 * MB, 0.01, 10 * MB / 8e9)
    # int8 and fp8 untried: transfers 2 and 4 (index 1, 3); then every 3rd: 7 and 10
    assert [(i, p.codec) for i, p in enumerate(picks) if p.reason == "explore"] == [
        (1, INT8), (3, FP8), (6, INT8), (9, FP8)]


def test_records_update_the_codec_lines_and_wire_ratio() -> None:
    chooser = CodecChooser(costs(CPU, RATIO), quiet(decay=0.5))
    before = chooser.predict("d", 10 * MB)["int8"]
    for _ in range(20):  # int8 got 4x slower to encode (a busy CPU) and compresses less
        chooser.record("d", INT8, 10 * MB, 5 * MB, 4 * CPU[INT8] * 10, 0.01)
    assert chooser._costs[INT8].wire_ratio == pytest.approx(0.5, abs=0.01)
    assert chooser.predict("d", 10 * MB)["int8"] > before + 2 * CPU[INT8] * 10
    assert chooser.decode_s(INT8, 10 * MB) == pytest.approx(CPU[INT8] * 10)  # decode stays the calibrated line


def test_line_fit_separates_the_fixed_cost_from_the_per_byte_one() -> None:
    fit = LineFit(decay=0.1)
    assert fit.line(0.001, 1e-9) is None and fit.predict(100, 0.5, 0.01) == pytest.approx(1.5)
    for x in (1e6, 4e6, 16e6, 2e6):
        fit.add(x, 0.003 + x / 2e9)
    fixed, per_byte = fit.line(0.0, 0.0)  # type: ignore[misc]
    assert fixed == pytest.approx(0.003, rel=1e-6) and per_byte == pytest.approx(1 / 2e9, rel=1e-6)
    same = LineFit()
    for _ in range(3):  # one size only: above the prior, the excess is fixed; below, the prior scales down
        same.add(1e6, 0.01)
    assert same.line(0.001, 4e-9) == pytest.approx((0.006, 4e-9))
    assert same.line(0.01, 1e-8) == pytest.approx((0.005, 5e-9))
    assert same.line(0.0, 0.0) == pytest.approx((0.0, 1e-8))


def test_a_slow_small_send_is_not_taken_for_a_slow_wire() -> None:
    """Sends of one small size that take milliseconds (a Ray call's overhead): the time goes to the
    fixed part mostly, so compressing a few KB is not predicted to save milliseconds."""
    # quantizing has a fixed cost, as the real codecs do (launching the per-block scale passes)
    chooser = CodecChooser(costs(CPU, RATIO, {NONE: 1e-5, INT8: 1e-4, FP8: 1e-4}), quiet())
    chooser.set_link("store", "node")
    for _ in range(5):
        chooser.record("store", NONE, 20_000, 20_000, 0.0, 0.005)
    choice = chooser.choose("store", 20_000)
    assert choice.codec == NONE
    assert choice.predicted_s["none"] == pytest.approx(0.005, rel=0.01)
    estimate = chooser.estimate("store")
    assert estimate.overhead_s == pytest.approx(0.005, rel=0.01) and estimate.bandwidth_bytes_per_s > 0.5e9


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        ChooserConfig(explore_every=1)
    with pytest.raises(ValueError):
        ChooserConfig(decay=0)
    with pytest.raises(ValueError, match="no cost"):
        CodecChooser({INT8: CodecCost(INT8)})


def test_calibration_measures_every_codec_on_the_layout() -> None:
    measured = calibrate(LAYOUT, torch.float32, sizes_bytes=(4096, 16384), reps=1)
    assert set(measured) == set(ALL_CODECS)
    for c, cost in measured.items():
        assert cost.encode.num_samples == 2 and cost.decode.num_samples == 2
        assert cost.codec_s(1 << 20) > 0
    assert measured[NONE].wire_ratio > 1.0  # headers
    assert measured[INT8].wire_ratio < 0.5 and measured[FP8].wire_ratio < 0.5  # of float32 KV
    chooser = CodecChooser.calibrated(LAYOUT, torch.bfloat16, cfg=quiet())
    assert set(chooser.predict("d", 1 << 20)) == {"none", "int8", "fp8", "zstd"}
    assert measured[ZSTD].wire_ratio < 1.0  # random normal KV: its exponents compress too


def test_exact_kv_picks_between_the_lossless_codecs_by_predicted_time() -> None:
    """The default fidelity: on a slow link zstd's fewer bytes win, on a fast one none; a lossy
    codec is never picked, however much faster it is predicted."""
    chooser = CodecChooser(costs(CPU, RATIO), quiet())
    feed_wire(chooser, "slow", 0.05e9)
    feed_wire(chooser, "fast", 20e9)
    exact = allowed_codecs("auto")
    slow = chooser.choose("slow", 50 * MB, exact)
    assert slow.codec == ZSTD and set(slow.predicted_s) == {"none", "zstd"}
    assert chooser.choose("fast", 50 * MB, exact).codec == NONE
    assert chooser.choose("slow", 50 * MB, allowed_codecs("auto", "lossy")).codec == FP8


SLOW_LINK = {**LINK_PRIORS, "cross_node": LinkPrior(0.1e9, 0.0)}  # every peer's wire: 0.1 GB/s


def test_a_lossy_codec_needs_a_real_gain_over_the_best_exact_one() -> None:
    # zstd predicted 3% slower than fp8: lossy buys too little, zstd goes (none is far slower)
    cpu = {NONE: 1e-4, INT8: 1e-2, FP8: 1e-3, ZSTD: 1e-3}
    chooser = CodecChooser(costs(cpu, {NONE: 1.0, INT8: 0.27, FP8: 0.25, ZSTD: 0.26}), quiet(), priors=SLOW_LINK)
    choice = chooser.choose("slow", 50 * MB, allowed_codecs("auto", "lossy"))
    assert choice.predicted_s["fp8"] < choice.predicted_s["zstd"] < 1.05 * choice.predicted_s["fp8"]
    assert choice.codec == ZSTD


def test_a_worker_without_a_host_codec_sends_exact_kv_as_none() -> None:
    """A device-shard worker is calibrated without zstd: an exact tenant's KV then goes as none."""
    device_costs = {c: cost for c, cost in costs(CPU, RATIO).items() if c is not ZSTD}
    chooser = CodecChooser(device_costs, quiet(), priors=SLOW_LINK)
    assert chooser.choose("slow", 50 * MB, (ZSTD,)).codec == NONE
    assert chooser.choose("slow", 50 * MB, allowed_codecs("auto")).codec == NONE
    assert chooser.choose("slow", 50 * MB, allowed_codecs("auto", "lossy")).codec == FP8
