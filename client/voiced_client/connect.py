"""Opening a channel to the daemon: TLS, the bearer token, and error messages a person can act on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

DEFAULT_SERVER = "127.0.0.1:50051"

# Reply audio arrives in chunks well under a megabyte; 16 MiB leaves room for a long Recognize result
# while still refusing a runaway message.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class Target:
    """Where and how to connect."""

    server: str = DEFAULT_SERVER
    token: str | None = None
    tls: bool = False
    ca_file: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Sent as plain call metadata rather than call credentials: gRPC refuses call credentials
        # on an insecure channel, and a daemon on 127.0.0.1 without TLS may still want a token.
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            if self.ca_file:
                raise ValueError("--ca needs --tls")
            return None
        root = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_channel_credentials(root_certificates=root)


def _host(server: str) -> str:
    return server.rsplit(":", 1)[0].strip("[]") if ":" in server else server


def _check_token(target: Target, creds) -> None:
    if target.token and creds is None and _host(target.server) not in ("127.0.0.1", "localhost", "::1"):
        log.warning("sending the bearer token to %s without TLS (use --tls)", target.server)


def sync_channel(target: Target) -> grpc.Channel:
    """A blocking grpc channel to `target`."""
    creds = target.credentials()
    _check_token(target, creds)
    if creds is None:
        return grpc.insecure_channel(target.server, options=_CHANNEL_OPTIONS)
    return grpc.secure_channel(target.server, creds, options=_CHANNEL_OPTIONS)


def aio_channel(target: Target, extra_options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` (call inside a running event loop)."""
    options = _CHANNEL_OPTIONS + list(extra_options or [])
    creds = target.credentials()
    _check_token(target, creds)
    if creds is None:
        return grpc.aio.insecure_channel(target.server, options=options)
    return grpc.aio.secure_channel(target.server, creds, options=options)


def describe_rpc_error(error: grpc.RpcError, server: str) -> str:
    """One line: the status name and the server's details, plus a hint for the common failures."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the server at {server}: {name}: {details}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{name}: {details} (pass the daemon's token with --token)"
    return f"{name}: {details}"
