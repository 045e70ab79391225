"""Calibrated conversion, one decoder block at a time.

    stage.CalibrationStage   the driver: calibration tokens, the block loop, progress, resume
    skeleton.Skeleton        the model on the meta device, one block materialised at a time
    streams.Streams          the original and converted hidden-state streams, with offload
    tokens                   calibration text: a file, an hf: dataset, or sampled from SRC
    block                    one block (`Block`), what a fit sees of it (`BlockContext`),
                             what it returns (`Fitted`) and the `Fit` protocol
    refit.AlignRefit         align-refit's fit: moments, head fit, o_proj refit, reconstruction
    fits                     the fits of the built-in methods that need data (`fit_for`)
    resume                   the state an interrupted run resumes from

This package never imports the pipeline: the pipeline runs the stage.
"""

from __future__ import annotations

from gqakit.convert.calibration.fits import fit_for
from gqakit.convert.calibration.resume import load_state
from gqakit.convert.calibration.stage import CalibrationStage
from gqakit.convert.calibration.tokens import calibration_sequences

__all__ = ["CalibrationStage", "calibration_sequences", "fit_for", "load_state"]
