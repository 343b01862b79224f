"""KV block transport: the protocol and its errors, backends by registry key, the link model, faults.

An engine builds one transport per emulated GPU with :func:`make_transport` and calls ``serve``,
``push``/``receive`` or ``publish``/``pull``, and ``close``; see :mod:`transport.base`.
"""

from transport.base import (
    Address,
    Block,
    BlockId,
    BlockNotFound,
    ConnectError,
    Delivery,
    FrameError,
    IntegrityError,
    KVTransport,
    PeerGone,
    RequestId,
    Site,
    TransferRecord,
    TransferTimeout,
    TransportClosed,
    TransportError,
    TransportOptions,
    TransportStats,
)
from transport.faulty import FaultPlan, FaultyTransport
from transport.link import LinkModel, ShapedTransport, Topology
from transport.registry import backend_factory, backends, make_transport, register

__all__ = [
    "Address",
    "Block",
    "BlockId",
    "BlockNotFound",
    "ConnectError",
    "Delivery",
    "FaultPlan",
    "FaultyTransport",
    "FrameError",
    "IntegrityError",
    "KVTransport",
    "LinkModel",
    "PeerGone",
    "RequestId",
    "ShapedTransport",
    "Site",
    "Topology",
    "TransferRecord",
    "TransferTimeout",
    "TransportClosed",
    "TransportError",
    "TransportOptions",
    "TransportStats",
    "backend_factory",
    "backends",
    "make_transport",
    "register",
]
