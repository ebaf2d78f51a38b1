"""The AudioSocket wire format, as Asterisk documents it (docs.asterisk.org, Channel Drivers / AudioSocket).

Every message is a 3-byte header, one byte of type and a big-endian 16-bit payload length, then the
payload:

    0x00  hangup (either side; closing the socket is a hangup too)
    0x01  the call's UUID, 16 bytes, first message from Asterisk
    0x03  a DTMF digit, 1 ASCII byte (Asterisk to us)
    0x10  signed linear 16-bit little-endian mono, 8 kHz
    0x11..0x18  the same at 12, 16, 24, 32, 44.1, 48, 96 and 192 kHz (added in late 2025, asterisk/asterisk
          PR #1492; the channel driver sends them when the channel's codec is slin12..slin192)
    0xff  an error; payload an optional application-specific code (Asterisk's own: one bit-packed
          byte, 0x01 hangup of the calling party, 0x02 frame forwarding error, 0x04 memory error)

This module holds the codec and its limits only; the door (voiced.doors.audiosocket) runs calls.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

HANGUP = 0x00
UUID = 0x01
DTMF = 0x03
ERROR = 0xFF
AUDIO_RATES = {0x10: 8000, 0x11: 12000, 0x12: 16000, 0x13: 24000, 0x14: 32000, 0x15: 44100, 0x16: 48000,
               0x17: 96000, 0x18: 192000}
RATE_KINDS = {rate: kind for kind, rate in AUDIO_RATES.items()}
ASTERISK_ERRORS = {0x01: "hangup of the calling party", 0x02: "frame forwarding error", 0x04: "memory (allocation) error"}
DTMF_DIGITS = frozenset("0123456789*#ABCD")

HEADER_BYTES = 3
MAX_AUDIO_MS = 1000  # Asterisk sends 20 ms frames; one second in a frame is a broken or hostile peer
MAX_ERROR_BYTES = 256


class Malformed(Exception):
    """A message that breaks the protocol; the message names the fault (it goes to the log)."""


@dataclass(frozen=True)
class Message:
    kind: int
    payload: bytes = b""

    @property
    def is_audio(self) -> bool:
        return self.kind in AUDIO_RATES

    @property
    def sample_rate(self) -> int:
        return AUDIO_RATES[self.kind]


def encode(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > 0xFFFF:
        raise ValueError(f"an AudioSocket payload holds at most 65535 bytes, not {len(payload)}")
    return bytes((kind,)) + len(payload).to_bytes(2, "big") + payload


def audio_kind(rate: int) -> int:
    """The message type for slin audio at `rate` Hz."""
    try:
        return RATE_KINDS[rate]
    except KeyError:
        raise ValueError(f"AudioSocket has no audio type for {rate} Hz; rates: {sorted(RATE_KINDS)}") from None


def max_audio_bytes(rate: int) -> int:
    return min(0xFFFF, rate * 2 * MAX_AUDIO_MS // 1000)


def kind_name(kind: int) -> str:
    if kind in AUDIO_RATES:
        return f"audio 0x{kind:02x} (slin {AUDIO_RATES[kind] / 1000:g} kHz)"
    return {HANGUP: "hangup 0x00", UUID: "UUID 0x01", DTMF: "DTMF 0x03", ERROR: "error 0xff"}.get(kind, f"0x{kind:02x}")


def check_header(kind: int, length: int) -> None:
    """Refuse a message from its header alone, before its payload is read."""
    if kind in AUDIO_RATES:
        limit = max_audio_bytes(AUDIO_RATES[kind])
        if length > limit:
            raise Malformed(f"{kind_name(kind)} message of {length} bytes is over the limit of {limit} "
                            f"({MAX_AUDIO_MS} ms of audio)")
        if length % 2:
            raise Malformed(f"{kind_name(kind)} message of {length} bytes: slin audio is whole 16-bit samples "
                            "(an even number of bytes)")
    elif kind == UUID:
        if length != 16:
            raise Malformed(f"UUID message of {length} bytes; a UUID is 16 bytes")
    elif kind == DTMF:
        if length != 1:
            raise Malformed(f"DTMF message of {length} bytes; a DTMF digit is 1 byte")
    elif kind == ERROR:
        if length > MAX_ERROR_BYTES:
            raise Malformed(f"error message of {length} bytes is over the limit of {MAX_ERROR_BYTES}")
    elif kind != HANGUP:
        raise Malformed(f"unknown message type 0x{kind:02x} (length {length})")


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None when the peer closed the connection between messages."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise Malformed(f"the connection closed inside a message header ({len(e.partial)} of 3 bytes)") from None
    kind, length = header[0], int.from_bytes(header[1:], "big")
    check_header(kind, length)
    if kind == HANGUP:
        return Message(HANGUP)  # whatever follows a hangup is not read
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError as e:
        raise Malformed(f"the connection closed inside a {kind_name(kind)} message "
                        f"({len(e.partial)} of {length} payload bytes)") from None
    return Message(kind, payload)


def parse_uuid(msg: Message) -> uuid.UUID:
    return uuid.UUID(bytes=msg.payload)


def parse_dtmf(msg: Message) -> str:
    digit = chr(msg.payload[0]).upper()
    if digit not in DTMF_DIGITS:
        raise Malformed(f"DTMF message holds {msg.payload!r}, not a digit (0-9, *, #, A-D)")
    return digit


def describe_error(payload: bytes) -> str:
    """Asterisk's bit-packed error byte in words (or the application's code as it came)."""
    if not payload:
        return "no error code"
    if len(payload) == 1:
        bits = [name for bit, name in ASTERISK_ERRORS.items() if payload[0] & bit]
        if bits and sum(ASTERISK_ERRORS) & payload[0] == payload[0]:
            return ", ".join(bits)
    if payload.isascii() and payload.decode().isprintable():
        return f"code {payload.decode()!r}"
    return f"code 0x{payload.hex()}"
