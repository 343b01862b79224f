"""KV block transport: the protocol and its errors, backends by registry key, the link model, faults.

How an engine uses it (one transport per emulated GPU; every time is emulated ms on its clock)::

    topology = Topology.from_cluster(spec)                        # once per process
    t = make_transport(spec.transport, site=Site(node, region), clock=clock, topology=topology)
    address = await t.serve()                                     # hand it to peers through Ray

    # prefill -> decode, push mode
    record = await t.push(peer_address, RequestId(rid), blocks, deadline_ms=clock.now_ms() + 500)
    # ... on the decode side
    with await t.receive(RequestId(rid), count=len(blocks), deadline_ms=...) as delivery:
        kv_cache.write(delivery.blocks)                           # or delivery.detach(into=slots)

    # pull mode: the producer publishes, the consumer pulls
    t.publish(RequestId(rid), blocks)                             # ... t.withdraw(rid) when done
    with await t.pull(producer_address, RequestId(rid), block_ids, deadline_ms=...) as delivery: ...

    await t.close()

Blocks are ``Block.of(block_id_or_hash, buffer, (first_layer, last_layer + 1))``. Records say how long
the transfer took over the emulated fabric and whether the real transport kept up. Errors are the
typed ``TransportError`` family. See :mod:`transport.base` for ownership, atomicity and deadlines.
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
