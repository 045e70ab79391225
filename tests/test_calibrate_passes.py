"""The calibration's block passes run consecutive spans together (`stage.PASS_TOKENS`): the
same fits as one span at a time."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import gqakit.convert.calibration.stage as stage
from gqakit.convert.pipeline import convert_checkpoint


@pytest.mark.numerics
@pytest.mark.parametrize("options", [
    {"steps": 0},  # the closed-form fits alone
    {"steps": 6, "loss": "attention", "train": "attention", "holdout": 0.25},  # with o_proj's refit after them
])
def test_passes_over_several_spans_at_once_give_the_fit_of_one_span_at_a_time(tiny_model, tmp_path, monkeypatch,
                                                                             options):
    """The block passes run consecutive spans together (`stage.PASS_TOKENS`): the moments, the o_proj
    fits, the targets the steps take and both streams are those of spans run one at a time, up to
    the order of float64 sums."""
    src = tiny_model("llama", num_key_value_heads=4, dtype=torch.float32)

    def run(out, pass_tokens):
        monkeypatch.setattr(stage, "PASS_TOKENS", pass_tokens)
        convert_checkpoint(src, out, 2, "align-refit", calibration_tokens=512, progress=False, device="cpu",
                           seed=1, options={"seq_len": 32, "batch": 1, "dtype": "float64", "step_dtype": "float64",
                                            **options})
        return load_file(out / "model.safetensors")

    together, alone = run(tmp_path / "together", 128), run(tmp_path / "alone", 1)  # 4 spans a pass, or 1
    assert together.keys() == alone.keys()
    for k, t in together.items():
        # float64 sums in another order (relative 1e-15 over a few hundred rows), through ridge solves and
        # 6 Adam steps, then rounded to the float32 output (6e-8): within a few float32 ulps, 1e-5 with room
        torch.testing.assert_close(t, alone[k], rtol=1e-5, atol=1e-6 * float(alone[k].abs().max()), msg=k)
