"""The transport's typed errors, and the two places that map foreign failures into them.

:func:`translate` maps a backend's own exceptions (``OSError``, asyncio timeouts, UCX errors, known by
class name so this module never imports ucxx) into the tree; :func:`error_from_wire` maps an error a
peer reported by its ``code``.
"""

from __future__ import annotations

import asyncio


class TransportError(Exception):
    """Base of every transport failure. ``code`` is the name sent on the wire when a peer reports it.

    ``maybe_delivered`` is true when a push failed after its commit had been sent: the receiver may
    have committed it (it refuses commits that reach it after the sender's deadline, so this happens
    only when the acknowledgement itself was late). Pushes are idempotent, so a retry is safe.
    """

    code = "transport"
    maybe_delivered = False


class ConnectError(TransportError):
    """The peer could not be reached (refused, unreachable, connect timed out): check its address."""

    code = "connect"


class TransferTimeout(TransportError, TimeoutError):
    """The call's deadline passed before it completed; nothing it moved stays registered."""

    code = "timeout"


class FrameError(TransportError):
    """Malformed or unexpected bytes on a connection; that connection is closed, others keep serving."""

    code = "frame"


class IntegrityError(TransportError):
    """Bytes arrived that differ from those sent (checksum or length mismatch); nothing was delivered."""

    code = "integrity"


class PeerGone(TransportError):
    """The connection closed or reset during the call; a later call reconnects."""

    code = "peer_gone"


class BlockNotFound(TransportError):
    """A pull asked for blocks the peer does not offer under that request id."""

    code = "not_found"


class TransportClosed(TransportError):
    """This transport was closed."""

    code = "closed"


_BY_CODE: dict[str, type[TransportError]] = {
    cls.code: cls
    for cls in (TransportError, ConnectError, TransferTimeout, FrameError, IntegrityError, PeerGone,
                BlockNotFound, TransportClosed)
}

# UCX errors by class name, so this module never imports ucxx.
_UCX_PEER_GONE = {"UCXConnectionResetError", "UCXCanceled", "UCXCloseError", "UCXNotConnectedError",
                  "UCXEndpointTimeoutError", "UCXUnreachableError"}
_UCX_CONNECT = {"UCXUnreachableError", "UCXConnectionRefusedError", "UCXRejectedError"}


def translate(exc: BaseException, what: str) -> TransportError:
    """Map any exception a backend raised into the transport's tree (the one place that does so).

    ``what`` says which operation failed and with whom; it prefixes the message. Typed errors pass
    through unchanged. ``asyncio.CancelledError`` is never translated: callers re-raise it.
    """
    if isinstance(exc, TransportError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, TimeoutError):
        err: TransportError = TransferTimeout(f"{what}: timed out")
    elif isinstance(exc, ConnectionRefusedError) or (name in _UCX_CONNECT and "connect" in what):
        err = ConnectError(f"{what}: connection refused ({exc})")
    elif isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, EOFError,
                          asyncio.IncompleteReadError)) or name in _UCX_PEER_GONE:
        err = PeerGone(f"{what}: connection lost ({name}: {exc})")
    elif isinstance(exc, OSError):
        err = ConnectError(f"{what}: {exc.strerror or exc}")
    elif name.startswith("UCX"):
        err = PeerGone(f"{what}: UCX error ({name}: {exc})")
    else:
        err = TransportError(f"{what}: unexpected {name}: {exc}")
    err.__cause__ = exc
    return err


def error_from_wire(code: str, message: str) -> TransportError:
    """The typed error a peer reported as ``code`` (unknown codes become the base class)."""
    return _BY_CODE.get(code, TransportError)(message)
