"""Kiln's wire protocol: frames, message types, op schemas. Imports nothing else of Kiln's."""

from .ops import SCHEMAS, SchemaError, validate_body
from .wire import (PROTOCOL_VERSION, TYPES, VERSION_FRAME, Message, ProtocolError, decode_frames,
                   encode_frames, make, new_id, version_error)

__all__ = ["PROTOCOL_VERSION", "TYPES", "VERSION_FRAME", "Message", "ProtocolError", "SCHEMAS",
           "SchemaError", "decode_frames", "encode_frames", "make", "new_id", "validate_body",
           "version_error"]
