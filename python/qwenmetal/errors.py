"""Exceptions raised by qwenmetal."""


class CheckpointError(ValueError):
    """A checkpoint (config.json, safetensors file or tensor) is missing, malformed or inconsistent.

    The message names the file and, where one is involved, the tensor.
    """


class InputError(ValueError):
    """An invalid argument of a call or field of a request: the message names it, and ``param`` holds its name
    (``"temperature"``, ``"messages[2].content"``, ...; the server reports it as the error's ``param``).
    ``code`` is ``"invalid_value"`` or ``"unsupported_value"`` (a well-formed value qwenmetal does not support)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code
