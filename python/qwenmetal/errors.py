"""Exceptions raised by qwenmetal."""


class CheckpointError(ValueError):
    """A checkpoint (config.json, safetensors file or tensor) is missing, malformed or inconsistent.

    The message names the file and, where one is involved, the tensor.
    """
