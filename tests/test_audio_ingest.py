import numpy as np
import pytest
from voiced_client import g711

from voiced.audio.ingest import FRAME_SAMPLES, AudioFormatError, Format, FrameDecoder, FrameEncoder, encode_pcm


def test_g711_matches_the_reference_codec_on_every_sample():
    audioop = pytest.importorskip("audioop")  # the stdlib codec, gone in Python 3.13
    x = np.arange(-32768, 32768, dtype=np.int16)
    assert g711.mulaw_encode(x) == audioop.lin2ulaw(x.tobytes(), 2)
    assert g711.alaw_encode(x) == audioop.lin2alaw(x.tobytes(), 2)
    codes = bytes(range(256))
    assert g711.mulaw_decode(codes).tobytes() == audioop.ulaw2lin(codes, 2)
    assert g711.alaw_decode(codes).tobytes() == audioop.alaw2lin(codes, 2)


def test_g711_known_code_words():
    # Silence and full scale, from the G.711 tables.
    assert g711.mulaw_encode(np.array([0, 32767, -32768], np.int16)) == bytes([0xFF, 0x80, 0x00])
    assert g711.alaw_encode(np.array([0, 32767, -32768], np.int16)) == bytes([0xD5, 0xAA, 0x2A])


@pytest.mark.parametrize("chunk", [1, 7, 160, 320, 641, 5000])
def test_any_chunk_size_becomes_the_same_20ms_frames(chunk):
    rng = np.random.default_rng(0)
    pcm = (rng.normal(0, 3000, 16000)).astype(np.int16)
    data = pcm.tobytes()
    chunk *= 2
    dec = FrameDecoder(Format("LINEAR16", 16000))
    frames = []
    for i in range(0, len(data), chunk):
        frames += dec.feed(data[i : i + chunk])
    frames += dec.flush()
    assert all(len(f) == FRAME_SAMPLES for f in frames)
    assert np.array_equal(np.concatenate(frames)[: len(pcm)], pcm)
    assert dec.caller_samples == len(pcm)


def test_whole_frame_messages_between_partial_ones_give_the_same_frames():
    """A 640-byte message is taken in one step only while nothing is pending; after a partial message the
    frames still run on from it."""
    pcm = (np.random.default_rng(1).normal(0, 3000, 16000)).astype(np.int16)
    data = pcm.tobytes()
    sizes, i, n, dec, frames = [640, 640, 100, 640, 540, 640, 2, 638, 640], 0, 0, FrameDecoder(Format("LINEAR16", 16000)), []
    while i < len(data):
        size = sizes[n % len(sizes)]
        frames += dec.feed(data[i: i + size])
        i, n = i + size, n + 1
    frames += dec.flush()
    assert all(len(f) == FRAME_SAMPLES and f.dtype == np.int16 for f in frames)
    assert np.array_equal(np.concatenate(frames)[: len(pcm)], pcm) and dec.caller_samples == len(pcm)


@pytest.mark.parametrize("fmt", [Format("MULAW", 8000), Format("ALAW", 8000), Format("LINEAR16", 48000)])
def test_telephony_and_wideband_input_is_resampled_to_16k_in_place(fmt):
    # A 440 Hz tone keeps its frequency and timing through decode + streaming resample.
    t = np.arange(fmt.sample_rate) / fmt.sample_rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 10000).astype(np.int16)
    data = encode_pcm(pcm, fmt.encoding)
    dec = FrameDecoder(fmt)
    step = fmt.bytes_per_sample * fmt.sample_rate // 50
    frames = []
    for i in range(0, len(data), step):
        frames += dec.feed(data[i : i + step])
    frames += dec.flush()
    out = np.concatenate(frames).astype(np.float32)
    assert abs(len(out) - 16000) <= FRAME_SAMPLES
    ref = np.sin(2 * np.pi * 440 * np.arange(len(out)) / 16000) * 10000
    core = slice(800, 15000)
    corr = np.dot(out[core], ref[core]) / np.linalg.norm(out[core]) / np.linalg.norm(ref[core])
    assert corr > 0.99  # same phase: no delay introduced by the resampler


def test_odd_length_linear16_is_refused_with_a_clear_message():
    dec = FrameDecoder(Format("LINEAR16", 16000))
    with pytest.raises(AudioFormatError, match="odd length"):
        dec.feed(b"\x00\x01\x02")


@pytest.mark.parametrize("fmt,msg", [(Format("OPUS", 16000), "unknown encoding"), (Format("LINEAR16", 4000), "outside")])
def test_bad_formats_are_refused(fmt, msg):
    with pytest.raises(AudioFormatError, match=msg):
        FrameDecoder(fmt)


def test_streamed_output_encoding_equals_encoding_the_whole():
    rng = np.random.default_rng(1)
    audio = (rng.normal(0, 0.2, 16000 * 2)).astype(np.float32)
    whole = FrameEncoder(Format("MULAW", 8000)).encode(audio, last=True)
    enc = FrameEncoder(Format("MULAW", 8000))
    pieces = [enc.encode(audio[i : i + 3200], last=i + 3200 >= len(audio)) for i in range(0, len(audio), 3200)]
    assert b"".join(pieces) == whole
