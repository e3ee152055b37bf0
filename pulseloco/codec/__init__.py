"""Wire formats: pure functions over tensors and bytes, no network.

The main entry points are :func:`encode_payload` / :func:`decode_payload` for a frame of named sparse tensors
and :func:`peek_header` to validate a frame and read its accounting without decompressing it.
"""

from pulseloco.codec.frame import (
    DEFAULT_MAX_ELEMENTS,
    FORMAT_VERSION,
    MAGIC,
    VALUE_MODES,
    DecodedPayload,
    FrameHeader,
    SparseTensor,
    decode_payload,
    encode_payload,
    peek_header,
)

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "FORMAT_VERSION",
    "MAGIC",
    "VALUE_MODES",
    "DecodedPayload",
    "FrameHeader",
    "SparseTensor",
    "decode_payload",
    "encode_payload",
    "peek_header",
]
