"""Exceptions raised by qwenmetal, and `brief`, how an error message shows a bad value."""
import json


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


class ImageError(InputError):
    """An image input that qwenmetal cannot take: unreadable or corrupt data, a format other than PNG, JPEG,
    WebP or GIF, an encoded size or pixel count over the limits of `qwenmetal.images`, a URL to fetch, a video.
    The message names what was given; ``code`` is ``"unsupported_value"`` for a well-formed input qwenmetal does
    not take (another format, a video, an http URL) and ``"invalid_value"`` otherwise."""


def brief(value, as_json: bool = False) -> str:
    """`value` for an error message, cut to 80 characters: its repr, or with `as_json` its JSON (strings
    still quoted by repr), as an API's error names what a client sent."""
    if as_json and not isinstance(value, str):
        r = json.dumps(value, ensure_ascii=False, default=str)
    else:
        r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."
