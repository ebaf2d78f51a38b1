"""The desktop push-to-talk client: microphone in, transcripts and agent text on the terminal,
reply audio out through the speakers, playback cut the moment a reply is interrupted.

The logic lives in `PttController` and `run_ptt`, which see the sound card only through the small
`AudioSource` / `AudioSink` interfaces and the keyboard only through a queue of key names, so tests
drive them with plain objects. `sounddevice` (PortAudio) is imported only by `run_cli`.

Keys: Enter or space toggles talking (a plain terminal has no key-up events, so press-and-hold is
not possible), q or Ctrl-D quits.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
import numpy as np

from .audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, AudioFormat, Encoding, decode
from .connect import Target, aio_channel
from .errors import ClientError
from .proto import voiced_pb2 as pb
from .proto import voiced_pb2_grpc as pb_grpc
from .session import SessionOptions, format_from_proto
from .wavio import resample

log = logging.getLogger(__name__)

MIC_RATE = 16000
FRAME_MS = 20

# voiced-client is not on PyPI: it installs from the checkout's client/ directory.
INSTALL_HINT = "pip install './client[ptt]' (from the voiced checkout)"
PORTAUDIO_HINT = "apt-get install libportaudio2 (macOS: brew install portaudio)"


# ----------------------------------------------------------------------------- audio interfaces


class AudioSource(Protocol):
    """A microphone: calls `on_frame(int16 mono samples)` every ~20 ms from any thread."""

    sample_rate: int

    def start(self, on_frame: Callable[[np.ndarray], None]) -> None: ...
    def stop(self) -> None: ...


class AudioSink(Protocol):
    """Speakers: `play` queues int16 mono samples at `sample_rate` and returns at once; `flush`
    drops everything queued so that playback goes silent within one device buffer."""

    sample_rate: int

    def play(self, pcm: np.ndarray) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class PlaybackBuffer:
    """A thread-safe sample FIFO between the event loop (writer) and an audio callback (reader)."""

    def __init__(self) -> None:
        self._chunks: deque[np.ndarray] = deque()
        self._lock = threading.Lock()
        self.queued = 0  # samples waiting

    def write(self, pcm: np.ndarray) -> None:
        with self._lock:
            self._chunks.append(np.asarray(pcm, dtype=np.int16))
            self.queued += len(pcm)

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self.queued = 0

    def read(self, n: int) -> np.ndarray:
        """Exactly n samples: what is queued, then silence (an underrun must not stall the device)."""
        out = np.zeros(n, dtype=np.int16)
        filled = 0
        with self._lock:
            while filled < n and self._chunks:
                chunk = self._chunks[0]
                take = min(n - filled, len(chunk))
                out[filled : filled + take] = chunk[:take]
                filled += take
                if take == len(chunk):
                    self._chunks.popleft()
                else:
                    self._chunks[0] = chunk[take:]
            self.queued -= filled
        return out


# --------------------------------------------------------------------------------- the logic


class TalkState(enum.Enum):
    IDLE = "idle"
    TALKING = "talking"


class PttController:
    """Push-to-talk state machine. Inputs: `toggle()`, `on_mic_frame()`, `handle_event()`, `quit()`
    (all on the event loop's thread). Outputs: requests on `self.requests` (None = half-close), audio
    to the sink, lines to `show`.

    Microphone audio is sent only while talking: a push-to-talk user expects the microphone to be
    private the rest of the time, and the server's utterances are the marked spans anyway."""

    def __init__(self, sink: AudioSink, show: Callable[[str], None] = print) -> None:
        self.sink = sink
        self.show = show
        self.state = TalkState.IDLE
        self.requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self.output_format = AudioFormat(Encoding.LINEAR16, sink.sample_rate)
        self.playing_reply: int | None = None  # between REPLY_STARTED and FINISHED/INTERRUPTED
        self.dropped_replies: set[int] = set()  # interrupted: late chunks are not played
        self.closed = False

    def _send(self, request: pb.SessionRequest | None) -> None:
        if not self.closed:
            self.requests.put_nowait(request)

    def toggle(self) -> None:
        if self.state is TalkState.IDLE:
            if self.playing_reply is not None:
                # The user is talking over the reply: silence the speakers now rather than after the
                # server's REPLY_INTERRUPTED arrives, and tell the server to stop generating it.
                self._stop_playback(self.playing_reply)
                self._send(pb.SessionRequest(control=pb.Control(stop_speaking=pb.StopSpeaking())))
            self.state = TalkState.TALKING
            self._send(pb.SessionRequest(control=pb.Control(talk_start=pb.TalkStart())))
            self.show("● talking… (Enter/space to stop)")
        else:
            self.state = TalkState.IDLE
            self._send(pb.SessionRequest(control=pb.Control(talk_end=pb.TalkEnd())))
            self.show("○ sent")

    def on_mic_frame(self, pcm: np.ndarray) -> None:
        if self.state is TalkState.TALKING:
            self._send(pb.SessionRequest(audio=np.asarray(pcm, dtype="<i2").tobytes()))

    def quit(self) -> None:
        if self.state is TalkState.TALKING:
            self.toggle()
        self._send(None)
        self.closed = True

    def _stop_playback(self, reply_id: int) -> None:
        self.sink.flush()
        self.dropped_replies.add(reply_id)
        self.playing_reply = None

    def handle_event(self, event: pb.SessionEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "started":
            cfg = event.started.effective_config
            if cfg.HasField("output_format"):
                self.output_format = format_from_proto(cfg.output_format)
            self.show(
                f"connected (session {event.started.session_id}); press Enter or space to talk, q to quit"
            )
        elif kind == "transcript":
            t = event.transcript
            if t.is_final:
                self.show(f"you: {t.text.strip()}")
            else:
                self.show(f"  … {t.text.strip()}")
        elif kind == "agent_text":
            self.show(f"agent: {event.agent_text.text.strip()}")
        elif kind == "reply":
            r = event.reply
            if r.type == pb.ReplyEvent.REPLY_STARTED:
                self.playing_reply = r.reply_id
            elif r.type == pb.ReplyEvent.REPLY_INTERRUPTED:
                self._stop_playback(r.reply_id)
                self.show(f"(reply interrupted after {r.audio_sent_ms / 1000:.1f} s)")
            elif r.type == pb.ReplyEvent.REPLY_FINISHED and self.playing_reply == r.reply_id:
                # Queued audio keeps playing; the reply is only over for barge-in purposes.
                self.playing_reply = None
        elif kind == "audio":
            chunk = event.audio
            if chunk.reply_id in self.dropped_replies:
                return
            if self.playing_reply is None and chunk.sequence == 0:
                self.playing_reply = chunk.reply_id  # tolerate a server that sends no REPLY_STARTED
            pcm = decode(chunk.audio, self.output_format.encoding)
            self.sink.play(resample(pcm, self.output_format.sample_rate, self.sink.sample_rate))
        elif kind == "notice":
            self.show(f"[{event.notice.code}] {event.notice.message}")
        elif kind == "dropped":
            self.show(f"  (not answered: {event.dropped.text.strip()!r} looks like a hallucination: "
                      f"{event.dropped.reason})")

    async def request_stream(self, config: pb.SessionConfig) -> AsyncIterator[pb.SessionRequest]:
        yield pb.SessionRequest(config=config)
        while (request := await self.requests.get()) is not None:
            yield request


async def run_ptt(
    channel: grpc.aio.Channel,
    options: SessionOptions,
    source: AudioSource,
    sink: AudioSink,
    keys: asyncio.Queue[str],
    show: Callable[[str], None] = print,
    metadata: tuple[tuple[str, str], ...] = (),
    drain_timeout: float = 10.0,
) -> PttController:
    """One push-to-talk session until the "quit" key (or the server ending the stream).

    `keys` yields "toggle" and "quit". Returns the controller (its state is what tests inspect)."""
    loop = asyncio.get_running_loop()
    controller = PttController(sink, show)
    call = pb_grpc.VoicedStub(channel).Converse(
        controller.request_stream(options.to_proto()), metadata=metadata or None
    )

    async def read_events() -> None:
        async for event in call:
            controller.handle_event(event)

    reader = asyncio.create_task(read_events())
    # Frames come from the audio thread; hop onto the loop so the controller needs no locks.
    source.start(lambda pcm: loop.call_soon_threadsafe(controller.on_mic_frame, pcm))
    key_task: asyncio.Task | None = None
    try:
        while not reader.done():
            key_task = asyncio.ensure_future(keys.get())
            done, _ = await asyncio.wait({key_task, reader}, return_when=asyncio.FIRST_COMPLETED)
            if key_task not in done:
                break
            key = key_task.result()
            if key == "toggle":
                controller.toggle()
            elif key == "quit":
                controller.quit()
                break
        if not reader.done():
            # Half-closed: let the server finish what it owes us (the last transcript, a reply).
            await asyncio.wait_for(asyncio.shield(reader), drain_timeout)
        await reader  # re-raises an error status
    except asyncio.TimeoutError:
        log.info("server did not end the session within %.0f s; closing", drain_timeout)
        call.cancel()
    finally:
        if key_task is not None and not key_task.done():
            key_task.cancel()
        source.stop()
        if not reader.done():
            reader.cancel()
    return controller


# ------------------------------------------------------------------------------- sound devices


def import_sounddevice():
    """Import sounddevice, or raise ClientError saying what to install."""
    try:
        import sounddevice
    except ImportError as e:
        raise ClientError(
            f"the push-to-talk client needs the sounddevice package ({e}): {INSTALL_HINT}"
        ) from e
    except OSError as e:  # sounddevice raises OSError when the PortAudio library is absent
        raise ClientError(f"PortAudio is not installed ({e}): {PORTAUDIO_HINT}") from e
    return sounddevice


def _device(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


class SoundDeviceSource:
    """The microphone through a sounddevice InputStream, 20 ms blocks of int16 mono."""

    def __init__(self, sd, device: int | str | None = None, sample_rate: int = MIC_RATE) -> None:
        self._sd = sd
        self.device = device
        try:
            sd.check_input_settings(device=device, channels=1, dtype="int16", samplerate=sample_rate)
            self.sample_rate = sample_rate
        except (ValueError, sd.PortAudioError):
            # Some devices only do 44.1/48 kHz; the server resamples, so send at the device's rate.
            info = sd.query_devices(device, kind="input")
            self.sample_rate = int(info["default_samplerate"])
            log.info("input device does not take %d Hz; sending %d Hz", sample_rate, self.sample_rate)
            if not MIN_SAMPLE_RATE <= self.sample_rate <= MAX_SAMPLE_RATE:
                raise ClientError(
                    f"the input device records at {self.sample_rate} Hz only; voiced takes "
                    f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz: choose another with --input-device"
                ) from None
        self._stream = None

    def start(self, on_frame: Callable[[np.ndarray], None]) -> None:
        def callback(indata, frames, time_info, status) -> None:
            if status:
                log.debug("input status: %s", status)
            on_frame(indata[:, 0].copy())

        self._stream = self._sd.InputStream(
            samplerate=self.sample_rate,
            blocksize=self.sample_rate * FRAME_MS // 1000,
            device=self.device,
            channels=1,
            dtype="int16",
            callback=callback,
        )
        self._stream.start()

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()
            self._stream.close()
            self._stream = None


class SoundDeviceSink:
    """The speakers through a sounddevice OutputStream fed from a PlaybackBuffer."""

    def __init__(self, sd, device: int | str | None = None, sample_rate: int = MIC_RATE) -> None:
        try:
            sd.check_output_settings(device=device, channels=1, dtype="int16", samplerate=sample_rate)
        except (ValueError, sd.PortAudioError):
            sample_rate = int(sd.query_devices(device, kind="output")["default_samplerate"])
        self.sample_rate = sample_rate
        self.buffer = PlaybackBuffer()

        def callback(outdata, frames, time_info, status) -> None:
            outdata[:, 0] = self.buffer.read(frames)

        # A small block keeps the cut on barge-in short: at most one block is already in the device.
        self._stream = sd.OutputStream(
            samplerate=sample_rate,
            blocksize=sample_rate * FRAME_MS // 1000,
            device=device,
            channels=1,
            dtype="int16",
            callback=callback,
            latency="low",
        )
        self._stream.start()

    def play(self, pcm: np.ndarray) -> None:
        self.buffer.write(pcm)

    def flush(self) -> None:
        self.buffer.clear()

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()


def open_devices(
    sd, input_device: str | None, output_device: str | None
) -> tuple[SoundDeviceSource, SoundDeviceSink]:
    """Open microphone and speakers, or raise ClientError naming what is missing."""
    try:
        sd.query_devices(_device(input_device), kind="input")
    except Exception as e:
        raise ClientError(
            f"no usable audio input device ({e}); connect a microphone or choose one with "
            "--input-device (see --list-devices)"
        ) from e
    try:
        sd.query_devices(_device(output_device), kind="output")
    except Exception as e:
        raise ClientError(
            f"no usable audio output device ({e}); choose one with --output-device (see --list-devices)"
        ) from e
    try:
        return SoundDeviceSource(sd, _device(input_device)), SoundDeviceSink(sd, _device(output_device))
    except sd.PortAudioError as e:
        raise ClientError(f"cannot open the audio device: {e}") from e


# ------------------------------------------------------------------------------------ keyboard


def start_key_reader(loop: asyncio.AbstractEventLoop, keys: asyncio.Queue[str]) -> Callable[[], None]:
    """Read single key presses in a thread; Enter/space -> "toggle", q/EOF -> "quit".

    Returns a function that restores the terminal. On a terminal, cbreak mode delivers each key
    at once (no Enter needed for space); without one (a pipe), lines are read instead."""
    post = lambda key: loop.call_soon_threadsafe(keys.put_nowait, key)
    restore: Callable[[], None] = lambda: None
    read_char: Callable[[], str]
    if sys.stdin.isatty() and os.name == "posix":
        import termios
        import tty

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        restore = lambda: termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        read_char = lambda: os.read(fd, 1).decode(errors="ignore")
    elif sys.stdin.isatty() and os.name == "nt":
        import msvcrt

        read_char = msvcrt.getwch
    else:
        read_char = lambda: sys.stdin.read(1)

    def reader() -> None:
        while True:
            ch = read_char()
            if ch in ("", "q", "Q", "\x04"):
                post("quit")
                return
            if ch in ("\n", "\r", " "):
                post("toggle")

    threading.Thread(target=reader, name="ptt-keys", daemon=True).start()
    return restore


def run_cli(args: argparse.Namespace, target: Target | None) -> int:
    sd = import_sounddevice()
    if args.list_devices:
        print(sd.query_devices())
        return 0
    assert target is not None
    source, sink = open_devices(sd, args.input_device, args.output_device)
    options = SessionOptions(
        input_format=AudioFormat(Encoding.LINEAR16, source.sample_rate),
        # A 96 kHz output device gets 48 kHz from the server, resampled here (PttController).
        output_format=AudioFormat(Encoding.LINEAR16, min(sink.sample_rate, MAX_SAMPLE_RATE)),
        push_to_talk=True,
        language=args.language,
        voice=args.voice,
        agent=args.agent,
    )

    async def session() -> None:
        keys: asyncio.Queue[str] = asyncio.Queue()
        restore = start_key_reader(asyncio.get_running_loop(), keys)
        channel = aio_channel(target)
        try:
            await run_ptt(channel, options, source, sink, keys, metadata=target.metadata())
        finally:
            restore()
            await channel.close()

    try:
        asyncio.run(session())
    finally:
        sink.close()
    return 0
