"""Mixed precision: the knapsack against brute force, a per-layer plan written byte for byte as the uniform
variants write each layer, loaded by torch and MLX, shown by plan and inspect, and chosen end to end under a budget
that held-out requests confirm."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clef_local.export.mixed import Candidate, choose_formats, layer_groups, parse_formats, write_mixed
from clef_local.export.staging import ExportError
from clef_local.formats.quant_plan import LayerFormat, mixed_plan
from clef_local.formats.quant_plan import layer_groups as plan_groups

INT4, INT8 = Candidate("int4", 32), Candidate("int8")


def _measured(rng: np.random.Generator, groups: int) -> list[dict]:
    out = []
    for _ in range(groups):
        source = int(rng.integers(800, 1200))
        out.append({"source_bytes": source, "formats": {
            "int4 g32": {"bytes": source // 3, "kl": float(rng.exponential(0.004))},
            "int8": {"bytes": source // 2, "kl": float(rng.exponential(0.0005))}}})
    return out


def test_choose_formats_is_the_smallest_plan_under_the_budget():
    rng = np.random.default_rng(0)
    for trial in range(40):
        measured = _measured(rng, 5)
        budget = float(rng.uniform(0.001, 0.02))
        chosen = choose_formats(measured, [INT4, INT8], budget)
        options = [[(m["source_bytes"], 0.0)] + [(m["formats"][c.label]["bytes"], m["formats"][c.label]["kl"])
                                                 for c in (INT4, INT8)] for m in measured]
        feasible = [sum(o[0] for o in combo) for combo in itertools.product(*options)
                    if sum(o[1] for o in combo) <= budget]
        got = [[None, INT4, INT8].index(c) for c in chosen]
        assert sum(o[k][1] for o, k in zip(options, got, strict=True)) <= budget, trial
        # exact up to the KL grid (budget / 2000 per step, each cost rounded up)
        assert sum(o[k][0] for o, k in zip(options, got, strict=True)) <= min(feasible) * 1.02, trial
    assert choose_formats(_measured(rng, 3), [INT4], 1e9) == [INT4] * 3
    with pytest.raises(ExportError, match="--max-kl must be > 0"):
        choose_formats(_measured(rng, 2), [INT4], 0)


def test_formats_and_groups_parse():
    assert parse_formats("int4,int4-g64,int8", 32) == [Candidate("int4", 32), Candidate("int4", 64), INT8]
    assert layer_groups(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for bad in ("int3", "int8-g64", "int4-g48", "int4,int4-g32", ""):
        with pytest.raises(ExportError, match="--mixed-formats"):
            parse_formats(bad, 32)


@pytest.fixture(scope="module")
def uniform(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from clef_local.export.quantize import quantize_release

    root = tmp_path_factory.mktemp("uniform")
    out = {"int4": root / "int4", "int8": root / "int8"}
    quantize_release(tiny_llama, out["int4"], "int4", 32, validate=False, log_summary=False)
    quantize_release(tiny_llama, out["int8"], "int8", validate=False, log_summary=False)
    return out


@pytest.fixture(scope="module")
def mixed(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "llama-mixed"
    plan = {0: LayerFormat("int4", 32), 1: LayerFormat("int8")}
    write_mixed(tiny_llama, out, plan, {"max_kl": 1.0, "note": "set by hand"}, max_kl=1.0, validate=False)
    return out


def test_each_layer_is_stored_as_its_uniform_variant_stores_it(mixed: Path, uniform: dict[str, Path]):
    import torch
    from safetensors.torch import load_file

    config = json.loads((mixed / "config.json").read_text())
    member = config["quantization_config"]["clef_local"]
    assert member["scheme"] == "mixed" and member["layers"] == {"0": {"scheme": "int4", "group_size": 32},
                                                                "1": {"scheme": "int8", "group_size": None}}
    assert mixed_plan(config) == {0: LayerFormat("int4", 32), 1: LayerFormat("int8")}
    ours = load_file(mixed / "model.safetensors")
    theirs = {k: {**load_file(v / "model.safetensors")} for k, v in uniform.items()}
    layer0 = [n for n in ours if ".layers.0." in n]
    layer1 = [n for n in ours if ".layers.1." in n]
    assert any(n.endswith(".scales") for n in layer0) and any(n.endswith(".weight_scale") for n in layer1)
    for names, scheme in ((layer0, "int4"), (layer1, "int8")):
        for name in names:
            mine, uniform_one = ours[name], theirs[scheme][name]
            assert mine.dtype == uniform_one.dtype and mine.view(-1).view(torch.uint8).equal(
                uniform_one.view(-1).view(torch.uint8)), name
    from clef_local.formats.manifest import verify

    assert verify(mixed) == []


def test_torch_loads_a_layer_per_scheme_and_matches_the_uniform_variant(tiny_llama: Path, mixed: Path,
                                                                        uniform: dict[str, Path], tmp_path: Path):
    import clef_local
    from clef_local.data.probes import probe_requests

    model = clef_local.load(mixed, dtype="float32", backend="torch")
    layers = model.backend.backbone.layers
    assert {k.split(":")[0] for p, k in layers.items() if ".layers.0." in p} == {"int4"}
    assert {k.split(":")[0] for p, k in layers.items() if ".layers.1." in p} == {"int8"}
    all_int4 = tmp_path / "all-int4"
    write_mixed(tiny_llama, all_int4, {0: LayerFormat("int4", 32), 1: LayerFormat("int4", 32)}, {}, max_kl=1.0,
                validate=False)
    requests = probe_requests(6, seed=2)
    same = clef_local.load(all_int4, dtype="float32").predict(requests)
    reference = clef_local.load(uniform["int4"], dtype="float32").predict(requests)
    for a, b in zip(same, reference, strict=True):
        for x, y in zip(a.probabilities, b.probabilities, strict=True):
            assert np.array_equal(x, y)
    broken = tmp_path / "broken"
    shutil.copytree(mixed, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["clef_local"]["layers"]["1"] = {"scheme": "int4", "group_size": 32}
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "clef_local_manifest.json").unlink()
    from clef_local.errors import ReleaseError

    with pytest.raises(ReleaseError, match="not a int4 layer"):
        clef_local.load(broken, dtype="float32", backend="torch")


def test_mlx_runs_the_mixed_variant_as_torch_does(mixed: Path):
    pytest.importorskip("mlx.core")
    import clef_local
    from clef_local.data.probes import probe_requests

    requests = probe_requests(4, seed=3)
    torch_p = clef_local.load(mixed, dtype="float32", backend="torch", device="cpu").predict(requests)
    mlx_model = clef_local.load(mixed, dtype="float32", backend="mlx", device="cpu")
    assert mlx_model.backend.describe()["kernels"]
    mlx_p = mlx_model.predict(requests)
    for a, b in zip(torch_p, mlx_p, strict=True):
        for x, y in zip(a.probabilities, b.probabilities, strict=True):
            assert float(np.abs(x - y).max()) <= 1e-4


def test_plan_and_inspect_show_the_groups(mixed: Path, capsys):
    from clef_local.decide import inspect_main
    from clef_local.planning.planner import main as plan_main

    assert plan_main(["--model", str(mixed), "--device", "cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert "layers 0" in out and "int4 g32" in out and "layers 1" in out and "int8" in out
    assert inspect_main(["--model", str(mixed), "--dtype", "float32"]) == 0
    described = json.loads(capsys.readouterr().out)
    groups = described["precision_groups"]
    assert [(g["layers"], g["format"]) for g in groups] == [("0", "int4 g32"), ("1", "int8")]
    assert groups[0]["bytes"] < groups[1]["bytes"]
    assert plan_groups({0: LayerFormat("int4", 32), 1: LayerFormat("int4", 32), 2: LayerFormat("bf16")}) == [
        ([0, 1], LayerFormat("int4", 32)), ([2], LayerFormat("bf16"))]


@pytest.mark.slow
def test_mixed_release_meets_its_budget_on_held_out_requests(tiny_llama: Path, tmp_path: Path):
    """Chosen on training-split probes, validated on the test-split ones: a loose budget takes the smallest format
    everywhere and passes validation at its budget; a tight one keeps more precision and its measured KL on the
    selection set stays within it (validated too, its int8 layers hold it to int8's 1% flip limit, which takes
    ~500 questions to show: not validated here, the selection is what this test is about)."""
    from clef_local.export.mixed import mixed_release

    # the tiny release's random weights lie on no 4-bit grid: int4 takes the default group, 64
    options = {"formats": "int4,int8", "group_layers": 1, "selection_requests": 6}
    loose = mixed_release(tiny_llama, tmp_path / "loose", 10.0, **options)
    assert set(loose["layers"].values()) == {"int4 g64"} and loose["validation"]["passed"]
    validation = loose["validation"]
    assert validation["checks"]["mean_kl"]["upper"] <= loose["max_kl"] and validation["verdict"] == "pass"
    assert validation["thresholds"] == {"mean_kl": 10.0, "flip_rate": 0.05}
    measured = loose["plan"]["groups"]
    smallest = min(m["formats"]["int4 g64"]["kl"] for m in measured)
    tight = mixed_release(tiny_llama, tmp_path / "tight", smallest / 2, validate=False, **options)
    assert "int4 g64" not in tight["layers"].values()
    assert tight["bytes"]["total_after"] > loose["bytes"]["total_after"]
    record = json.loads((tmp_path / "tight" / "config.json").read_text())["quantization_config"]["clef_local"]
    assert record["plan"]["rounds"][-1]["measured_kl"] <= tight["max_kl"] and "training splits" in \
        record["plan"]["selection"]


def test_quantize_mixed_flags(tiny_llama: Path, tmp_path: Path, capsys):
    from clef_local.export.quantize import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tiny_llama), "--format", "mixed", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--max-kl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_llama), "--bits", "4", "--max-kl", "0.1", "--out", str(tmp_path / "x")])
    assert "apply with --format mixed only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
