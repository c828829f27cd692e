"""The layer atlas: top values with their token positions, the per-layer x site figures, the heatmaps, the plan
overlay and `profile --model`'s atlas files. Tiny FFNs (d_model 32) and tiny model folders only."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ffnquant.atlas import PositionTracker, layer_atlas, split_sequences, top_positions
from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.model import build
from ffnquant.numerics.observe import profile
from ffnquant.report.atlas import ATLAS_FILES, atlas_markdown, plan_grid, render_atlas_plots
from ffnquant.spec import FFNSpec, parse_variant

from hf_models import D, tiny_folders, write_llama_like

D_MODEL, SEQ_LEN, N_SEQ = 32, 16, 8
CHANNEL = 7
# A planted value of 60 at input channel 7: the largest Gaussian of the 4,096 inputs lies near 4 std out, so 60 is
# the input's largest magnitude by a factor of ~15 and, pushed through the weights, the largest at every later site.
PLANTED = 60.0


def _sequences(seed: int = 0, plant: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(SEQ_LEN, D_MODEL, generator=gen) for _ in range(N_SEQ)]
    if plant:
        for s in seqs:
            s[0, CHANNEL] = PLANTED
    return seqs


def _ffn(variant: str):
    return build(FFNSpec(parse_variant(variant), d_model=D_MODEL), seed=0)


def _brute_force(ffn, seqs, site: str, fraction: float) -> tuple[int, int, float]:
    """(top count, how many of them at position 0, the smallest |value| kept) from the whole site tensor at once."""
    got = {}
    handle = ffn.taps[site].register_forward_hook(lambda m, i, o: got.setdefault("y", o.detach()))
    with torch.no_grad():
        ffn(torch.cat(seqs))
    handle.remove()
    y = got["y"]
    count = max(1, math.ceil(fraction * y.numel()))
    vals, idx = torch.topk(y.abs().reshape(-1), count)
    pos = (idx // y.shape[-1]) % SEQ_LEN
    return count, int((pos == 0).sum()), float(vals[-1])


@pytest.mark.parametrize("variant", ["swiglu", "gelu"], ids=["gated-swiglu", "dense-gelu"])
def test_top_positions_find_the_planted_outlier_at_position_0_channel_7(variant):
    ffn = _ffn(variant)
    result = top_positions(ffn, _sequences(), k=5)
    assert set(result) == set(ffn.taps.keys())
    top = result["input"]["top"]
    # the planted value in every sequence: the five largest, in reading order (sequence, position, channel)
    assert [(t["sequence"], t["position"], t["channel"], t["value"]) for t in top] == [
        (i, 0, CHANNEL, PLANTED) for i in range(5)]
    for site, r in result.items():
        assert r["top"][0]["position"] == 0, site  # every site's largest value comes from the planted token
        assert r["position0"] + r["elsewhere"] == r["top_count"]
        assert r["position0_baseline"] == pytest.approx(1 / SEQ_LEN)
    assert result["input"]["position0_share"] == 1.0 and result["input"]["top_set_channels"][0][0] == CHANNEL


@pytest.mark.parametrize("chunks", [1, 3, 8], ids=lambda n: f"{n}-updates")
def test_the_streaming_top_set_is_exact_and_matches_the_whole_tensor(chunks):
    """The tracker keeps the top fraction of `max_tokens` per update and merges: any split of the sequences gives the
    brute-force top set of the whole site tensor (count, position-0 count, threshold)."""
    ffn, seqs, fraction = _ffn("swiglu"), _sequences(seed=1), 0.01
    tracker = PositionTracker(ffn, max_tokens=SEQ_LEN * N_SEQ, top_fraction=fraction)
    step = math.ceil(N_SEQ / chunks)
    for start in range(0, N_SEQ, step):
        tracker.update(seqs[start:start + step])
    result = tracker.result()
    for site in ("input", "hidden", "output"):
        count, at0, threshold = _brute_force(ffn, seqs, site, fraction)
        r = result[site]
        assert (r["top_count"], r["position0"], r["threshold"]) == (count, at0, threshold), site
    assert result["input"]["position0"] >= N_SEQ  # the planted values are all in the top 1%


def test_feeding_more_than_max_tokens_is_refused():
    tracker = PositionTracker(_ffn("gelu"), max_tokens=SEQ_LEN)
    with pytest.raises(FFNQuantError, match="max_tokens"):
        tracker.update(_sequences()[:2])
    with pytest.raises(FFNQuantError, match="site"):
        PositionTracker(_ffn("gelu"), max_tokens=8, sites=["gate_pre"])  # a dense FFN has no gate


def test_split_sequences_undoes_the_capture_layout():
    """hf.capture flattens each batch [batch, seq_len] row-major into [tokens, d_model]; the text's last, shorter
    window comes in its own batch: splitting the concatenated rows by seq_len gives the windows back."""
    windows = [torch.randn(SEQ_LEN, D_MODEL) for _ in range(5)] + [torch.randn(5, D_MODEL)]
    batches = [torch.stack(windows[0:4]), torch.stack(windows[4:5]), windows[5][None]]
    rows = torch.cat([b.reshape(-1, D_MODEL) for b in batches])
    got = split_sequences(rows, SEQ_LEN)
    assert len(got) == len(windows) and all(torch.equal(a, b) for a, b in zip(got, windows))


@pytest.fixture(scope="module")
def layers():
    """Three layers' tables (L0 and L2 with the planted outlier, L1 without) and L0's top positions."""
    ffn, seqs = _ffn("swiglu"), _sequences()
    table, clean = profile(ffn, seqs), profile(ffn, _sequences(seed=2, plant=False))
    return {"llama:L0": table, "llama:L1": clean, "llama:L2": table}, {"L0": top_positions(ffn, seqs)}


@pytest.fixture(scope="module")
def atlas(layers):
    return layer_atlas(*layers)


@pytest.fixture(scope="module")
def plots(atlas):
    return render_atlas_plots(atlas)


def test_the_atlas_finds_channel_7_and_position_0(atlas):
    assert [r["label"] for r in atlas["layers"]] == ["L0", "L1", "L2"] and atlas["positions_measured"]
    l0, l1 = atlas["layers"][0]["sites"], atlas["layers"][1]["sites"]
    assert l0["input"]["top_channels"][0]["channel"] == CHANNEL and l0["input"]["absmax"] == PLANTED
    assert l0["input"]["positions"]["top"][0]["position"] == 0
    assert l0["input"]["outlier_channels"] == {"6": 1, "20": 1}  # 60 against a median channel absmax near 3
    assert l1["input"]["outlier_channels"] == {"6": 0, "20": 0} and l1["input"]["positions"] is None
    # the planted layers are the worst by crest factor at the input, and channel 7 recurs in both
    assert {d["label"] for d in atlas["worst"]["input"]["crest_factor"][:2]} == {"L0", "L2"}
    assert atlas["recurring_channels"]["input"][0] == {"channel": CHANNEL, "layers": ["L0", "L2"],
                                                       "max_absmax": PLANTED}
    json.dumps(atlas, allow_nan=False)  # JSON-able, no NaN


def test_a_layer_far_above_the_others_stands_out_with_its_channel_and_position(layers):
    (planted, clean), tops = (layers[0]["llama:L0"], layers[0]["llama:L1"]), layers[1]
    atlas = layer_atlas({"llama:L0": clean, "llama:L1": clean, "llama:L2": planted, "llama:L3": clean},
                        {"L2": tops["L0"]})
    # 60 against the clean layers' ~4: 15x the median layer's absmax, above the 10x of STANDOUT_RATIO
    (found,) = atlas["standouts"]["input"]
    assert (found["label"], found["channel"], found["position"], found["absmax"]) == ("L2", CHANNEL, 0, PLANTED)
    assert found["ratio"] >= atlas["standout_ratio"]
    md = atlas_markdown(atlas)
    assert "| `input` | L2 | 60 |" in md.split("## Standouts")[1].split("##")[0]


def test_heatmap_png_bytes_are_deterministic_and_not_empty(atlas, plots):
    again = render_atlas_plots(atlas)
    assert set(plots) == {"ranges", "top"}
    for key, blob in plots.items():
        assert blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 10_000, key
        assert blob == again[key], key


PLAN = {1: {"input": "w8a8-dyn", "hidden": "bf16"}, 2: {"hidden": "w4a16-g128"}}


def test_the_plan_overlay_reaches_the_grid_the_markdown_and_the_image(atlas, plots):
    assert plan_grid(atlas, PLAN) == [{}, {"input": "w8a8-dyn", "hidden": "bf16"}, {"hidden": "w4a16-g128"}]
    md = atlas_markdown(atlas, {"ranges": ATLAS_FILES["ranges"]}, PLAN)
    plan_section = md.split("## Plan")[1]
    assert "| L1 | `input` | w8a8-dyn |" in plan_section and "| L2 | `hidden` | w4a16-g128 |" in plan_section
    assert "![" in md and ATLAS_FILES["ranges"] in md
    assert render_atlas_plots(atlas, PLAN)["ranges"] != plots["ranges"]  # the plan panel is drawn
    with pytest.raises(FFNQuantError, match="valid: 0, 1, 2"):
        plan_grid(atlas, {9: {"input": "bf16"}})
    with pytest.raises(FFNQuantError, match="gate_pre"):
        plan_grid(atlas, {0: {"gate": "bf16"}})


def test_the_markdown_names_the_worst_layers_and_position_0(atlas, layers):
    md = atlas_markdown(atlas, measured_on="on the test sequences.")
    assert "Token positions: on the test sequences." in md
    worst = next(line for line in md.splitlines() if line.startswith("| `input` |"))
    assert "L0" in worst and "L2" in worst
    assert "## Position 0" in md and f"ch {CHANNEL}" in md
    assert "Token positions were not measured." in atlas_markdown(layer_atlas(layers[0]))


def _captured_model(tmp_path):
    """A hand-written 2-layer llama folder and captured inputs for it (no transformers needed)."""
    import numpy as np

    write_llama_like(tmp_path / "m")
    folder = tmp_path / "captured"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for label in ("L0", "L1"):
        np.save(folder / f"{label}.npy", torch.randn(200, D, generator=gen).numpy())
    return ["--model", str(tmp_path / "m"), "--captured", str(folder)]


SYNTHETIC = ["profile", "--variants", "gelu", "--d-model", "32", "--tokens", "128", "--bins", "256"]


def test_profile_model_from_captured_files_writes_the_atlas_without_positions(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(SYNTHETIC + _captured_model(tmp_path) + ["--out", str(out)]) == 0
    assert "captured files do not record where their sequences start" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= set(ATLAS_FILES.values())
    data = json.loads((out / "atlas.json").read_text())
    assert [r["label"] for r in data["layers"]] == ["L0", "L1"] and not data["positions_measured"]


def test_a_failing_atlas_leaves_the_output_folder_as_it_was(tmp_path, monkeypatch):
    import ffnquant.report.atlas as report_atlas

    def broken(*args, **kwargs):
        raise FFNQuantError("the atlas could not be drawn")

    monkeypatch.setattr(report_atlas, "render_atlas_plots", broken)
    out = tmp_path / "r"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    assert main(SYNTHETIC + _captured_model(tmp_path) + ["--out", str(out)]) == 2
    # the range report was written before the atlas failed: the transaction moved nothing into place
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


@pytest.mark.hf
def test_profile_model_writes_the_atlas_with_positions_on_the_same_tokens(tmp_path_factory, tmp_path, capsys):
    folder = tiny_folders(tmp_path_factory, ("llama",))["llama"][0]
    out = tmp_path / "r"
    assert main(SYNTHETIC + ["--model", str(folder), "--layers", "1", "--model-tokens", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer atlas" in printed and "wrote " + str(out / "atlas_ranges.png") in printed
    data = json.loads((out / "atlas.json").read_text())
    ranges = json.loads((out / "ranges.json").read_text())
    assert data["positions_measured"] and "256 tokens of text" in data["meta"]["positions_measured_on"]
    assert [row["label"] for row in data["layers"]] == ["L1"]
    for row in data["layers"]:
        assert row["n_tokens"] == ranges["variants"][row["key"]]["n_tokens"] == 256
        for site, cell in row["sites"].items():
            # the second run sees the very tokens the ranges were measured on: its largest |value| is their absmax
            assert abs(cell["positions"]["top"][0]["value"]) == cell["absmax"], (row["label"], site)
    md = (out / "atlas.md").read_text()
    assert "atlas_ranges.png" in md and "atlas_top.png" in md and "## Hardest layers per site" in md
    for name in ("atlas_ranges.png", "atlas_top.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
