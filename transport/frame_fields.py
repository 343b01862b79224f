"""The metadata of a msgpack frame (:mod:`transport.frame`): decoded into a map, and its fields read with their
types checked (a handler reads each field it needs through one of these; a field of the wrong type is a
``FrameError`` naming it, never a ``TypeError`` deep in the handler)."""

from __future__ import annotations

from typing import Any

import msgpack

from transport.base import FrameError


def unpack_meta(meta_b: bytes | memoryview) -> dict[str, Any]:
    """The metadata map of a frame (FrameError when it is not msgpack, or not a map)."""
    try:
        meta = msgpack.unpackb(meta_b, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated classes on garbage
        raise FrameError(f"frame metadata is not valid msgpack: {type(e).__name__}") from e
    if not isinstance(meta, dict):
        raise FrameError(f"frame metadata must be a map, got {type(meta).__name__}")
    return meta


def field_int(meta: dict[str, Any], key: str) -> int:
    """``meta[key]`` as an int, or FrameError naming the field."""
    v = meta.get(key)
    if type(v) is not int:
        raise FrameError(f"frame field {key!r} must be an integer, got {type(v).__name__}")
    return v


def field_str(meta: dict[str, Any], key: str) -> str:
    v = meta.get(key)
    if not isinstance(v, str):
        raise FrameError(f"frame field {key!r} must be a string, got {type(v).__name__}")
    return v


def field_bool(meta: dict[str, Any], key: str) -> bool:
    v = meta.get(key)
    if not isinstance(v, bool):
        raise FrameError(f"frame field {key!r} must be a boolean, got {type(v).__name__}")
    return v


def field_layers(meta: dict[str, Any], key: str = "l") -> tuple[int, int]:
    v = meta.get(key)
    if (not isinstance(v, list) or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int
            or not 0 <= v[0] < v[1]):
        raise FrameError(f"frame field {key!r} must be a layer range [start, stop] with 0 <= start < stop")
    return v[0], v[1]


def field_int_list(meta: dict[str, Any], key: str) -> list[int]:
    v = meta.get(key)
    if not isinstance(v, list) or any(type(x) is not int for x in v):
        raise FrameError(f"frame field {key!r} must be a list of integers")
    return v
