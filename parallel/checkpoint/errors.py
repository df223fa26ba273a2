"""The error every checkpoint module raises for a checkpoint that cannot be used as asked."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the file/tensor and the fix."""
