"""Inputs the vision-tower tests share (tests/test_vision_reference.py, tests/test_vision_cpu.py,
tests/metal/test_vision_metal.py): random pixel rows for a grid, and the bad inputs every tower must refuse with
the reference's InputError messages (`qwenmetal.backends.reference_vision.check_inputs`)."""
from __future__ import annotations

import numpy as np


def pixels(vc, grid, seed: int = 0) -> np.ndarray:
    """Random float32 pixel rows [patches of `grid`, vc.patch_dim]."""
    n = int(np.prod(np.asarray(grid), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, vc.patch_dim)).astype(np.float32)


def bad_inputs(px: np.ndarray, grid: np.ndarray) -> list:
    """(pixel_values, grid_thw, message regex) for each bad input, from good `px` of the one-image [[1, 4, 6]]
    `grid`."""
    n, d = px.shape
    cut = d // 2
    return [
        (px[:, :cut], grid, rf"pixel_values must be \[{n}, {d}\].*got \[{n}, {cut}\]"),
        (px[:n - 4], grid, rf"pixel_values must be \[{n}, {d}\]"),
        (px, np.array([[1, 3, 8]]), r"grid_thw\[0\] = \[1, 3, 8\]: height and width must be multiples of"),
        (px, np.array([[0, 4, 6]]), r"grid_thw\[0\] = \[0, 4, 6\]: every entry must be positive"),
        (px, np.array([1, 4, 6]), r"grid_thw must be an integer array \[n_images, 3\]"),
        (px, grid.astype(np.float32), r"grid_thw must be an integer array"),
        (px.astype(np.int32), grid, r"pixel_values must be floating point"),
        (np.where(np.arange(d) == 5, np.nan, px), grid, r"pixel_values holds NaN"),
    ]
