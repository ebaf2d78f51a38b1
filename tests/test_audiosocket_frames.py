"""The AudioSocket codec against the protocol text: types, rates, limits, and Asterisk's error byte."""

from __future__ import annotations

import asyncio
import struct
import uuid

import pytest

from voiced.doors import audiosocket_frames as wire


def stream_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_every_documented_audio_type_and_its_rate():
    # docs.asterisk.org: 0x10 8 kHz, then 0x11..0x18 12, 16, 24, 32, 44.1, 48, 96, 192 kHz
    documented = [8000, 12000, 16000, 24000, 32000, 44100, 48000, 96000, 192000]
    assert [wire.AUDIO_RATES[k] for k in range(0x10, 0x19)] == documented
    for rate in documented:
        frame = bytes(range(256)) * (rate // 50 * 2 // 256) + b"\x00" * (rate // 50 * 2 % 256)
        reader = stream_of(struct.pack(">BH", wire.audio_kind(rate), len(frame)) + frame)
        msg = await wire.read_message(reader)
        assert msg.is_audio and msg.sample_rate == rate and msg.payload == frame
        assert await wire.read_message(reader) is None  # closed between messages: a hangup


async def test_uuid_dtmf_hangup_and_encode_round_trip():
    call = uuid.UUID("40325ec2-5efd-4bd3-805f-53576e581d13")
    data = wire.encode(wire.UUID, call.bytes) + wire.encode(wire.DTMF, b"#") + b"\x00\x00\x00"
    assert data[:3] == b"\x01\x00\x10"  # as Asterisk writes it: type, then the length big-endian
    reader = stream_of(data)
    assert wire.parse_uuid(await wire.read_message(reader)) == call
    assert wire.parse_dtmf(await wire.read_message(reader)) == "#"
    assert (await wire.read_message(reader)).kind == wire.HANGUP


@pytest.mark.parametrize("data, fault", [
    (b"\x42\x00\x02xx", "unknown message type 0x42"),
    (b"\x01\x00\x0f" + bytes(15), "UUID message of 15 bytes"),
    (b"\x10\x4e\x20", "over the limit of 16000"),  # 20000 bytes of 8 kHz slin: 1.25 s in one message
    (b"\x12\x01\x41", "even number of bytes"),
    (b"\x03\x00\x02" + b"12", "a DTMF digit is 1 byte"),
    (b"\x10\x01", "inside a message header"),
    (b"\x10\x01\x40" + bytes(100), "100 of 320 payload bytes"),
])
async def test_faults_are_named(data, fault):
    with pytest.raises(wire.Malformed, match=fault):
        await wire.read_message(stream_of(data))


def test_limits_never_exceed_what_the_length_field_holds():
    assert wire.max_audio_bytes(8000) == 16000
    assert wire.max_audio_bytes(192000) == 0xFFFF
    with pytest.raises(ValueError):
        wire.encode(wire.ERROR, bytes(70000))


def test_asterisk_error_byte_in_words():
    assert wire.describe_error(b"\x01") == "hangup of the calling party"
    assert wire.describe_error(b"\x06") == "frame forwarding error, memory (allocation) error"
    assert wire.describe_error(b"over_capacity") == "code 'over_capacity'"
    assert wire.describe_error(b"\x08\x00") == "code 0x0800"
    assert wire.describe_error(b"") == "no error code"
