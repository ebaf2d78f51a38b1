"""Benchmark callers for the telephony doors, and the voice-to-voice clock every door's caller shares.

Voice-to-voice as a caller hears it: from the moment the daemon detects the end of the caller's
speech to the arrival of the reply's first audio. The caller knows when that end is detected without
being told: it runs the daemon's own segmenter (same settings, same frames: for mu-law, the same
decode and resampling) over exactly the frames it sends, in order, and notes the send time of the
frame on which an utterance ends. The daemon acts on that frame when it arrives, so the clock starts
within a network hop of the daemon's own. Replies are matched to utterances in order (barge-in is off
in the benchmark, and every utterance gets one reply), so the same figure is measured the same way
for gRPC, AudioSocket and the media WebSocket, and their difference is each door's overhead.

Voice-to-voice from the caller's real end of speech (`v2v_real_end_ms`) adds the time the daemon took
to decide the turn was over: the caller also notes the last sound it sent before each decided end (a
sample louder than voiced.bench.turn_set.LOUD, dated as if spoken when its 20 ms frame went out), and
times the same reply from there. That is the voice's real end for a WAV that is quiet between
utterances, as espeak-ng's are; over a noisy WAV it falls on the noise and equals the other figure.

Where each door's reply starts: gRPC, the audio chunk with sequence 0; AudioSocket, every
`reply_seconds` of frames (the benchmark forces each reply to that length); the media WebSocket, the
first `media` after our previous reply's `mark`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import struct
import time
import uuid

import numpy as np

FRAME_S = 0.02


class EndOfSpeech:
    """When each of the caller's utterances ended: as decided, and as really spoken (its last sound).

    A door that tells the caller (gRPC's SPEECH_ENDED) gives the decision itself (`decided`); for the
    others the daemon's own segmenter runs over the caller's frames, which is their decision only with
    silence turn detection (the default of `Config()`): a smart detector ends turns sooner."""

    def __init__(self, fmt=None, door_decides: bool = False):
        from voiced.audio.ingest import Format, FrameDecoder
        from voiced.config import Config
        from voiced.core.segmenter import Segmenter, Utterance
        from voiced.core.spec import segmentation_for

        self._decoder = FrameDecoder(fmt or Format("LINEAR16", 16000))
        self._segmenter = Segmenter(segmentation_for(Config()))
        self._utterance = Utterance
        # (decided, real end) send times of utterance ends not yet matched to a reply
        self.ends: collections.deque[tuple[float, float]] = collections.deque()
        # the same for the turns the door ended, by turn id; those with words (a final transcript with text)
        # are owed a reply. A turn the daemon drops (its words a hallucination, such as a fragment of a word
        # at the start of a looped WAV) gets neither: in a queue it would take the next turn's reply.
        self.turns: dict[int, tuple[float, float]] = {}
        self.owed: set[int] = set()
        self.utterances = 0
        self._last_sound = 0.0  # when the last loud sample was spoken
        self.door_decides = door_decides
        # turns the door ended before this clock's segmenter found their end (`decided`), oldest first
        self._ahead: collections.deque[int] = collections.deque()

    def sent(self, data: bytes, at: float) -> None:
        from voiced.bench.turn_set import LOUD

        for frame in self._decoder.feed(data):
            loud = np.nonzero(np.abs(frame) > LOUD * 32768)[0]
            if len(loud):
                self._last_sound = at - (len(frame) - 1 - int(loud[-1])) / 16000
            if self.door_decides:
                continue
            for event in self._segmenter.push(frame):
                if isinstance(event, self._utterance) and len(event.audio):
                    self._found_end(at)

    def decided(self, at: float, turn: int | None = None) -> None:
        """The door said the utterance (turn id `turn`, where it says) ended (received at `at`); its real end
        is the last sound sent.

        Where this clock's own segmenter decides (silence detection: it hears the very frames with the
        daemon's settings, and sooner), the door's end only names the utterance it found first: its times
        stay the segmenter's, now under the turn's id."""
        if turn is not None and not self.door_decides and self.ends:
            self.turns[turn] = self.ends.popleft()
            return
        # A door that decides, or one whose end came before this clock's segmenter found it (a caller that
        # feeds the clock after its write, on a busy machine): the door's end is the one counted, and the
        # segmenter's later end of the same utterance is not another.
        end = (at, min(self._last_sound, at))
        if turn is None:
            self.ends.append(end)
        else:
            self.turns[turn] = end
            if not self.door_decides:
                self._ahead.append(turn)
        self.utterances += 1

    @property
    def without_words(self) -> int:
        """Turns the door ended that got no transcript with words (nor a reply): dropped, such as a word's tail."""
        return len(self.turns.keys() - self.owed)

    def transcribed(self, turn: int) -> None:
        """The turn's final transcript came, with words: it is owed a reply."""
        self.owed.add(turn)

    def unanswered(self) -> int:
        """Utterances whose reply never came: those with words, where the door names turns."""
        return len(self.ends) + len(self.owed & self.turns.keys())

    def finished(self, at: float) -> None:
        """The caller finished sending (gRPC's half-close): the daemon ends the utterance in progress."""
        if self.door_decides:
            return  # its SPEECH_ENDED, if any, still arrives and is counted by `decided`
        for frame in self._decoder.flush():
            self._segmenter.push(frame)
        for event in self._segmenter.flush():
            if isinstance(event, self._utterance) and len(event.audio):
                self._found_end(at)

    def _found_end(self, at: float) -> None:
        """This clock's segmenter found an utterance's end at `at`."""
        if self._ahead:  # the door's end of this utterance came first: it is counted already
            self._ahead.popleft()
            return
        self.ends.append((at, min(self._last_sound, at)))
        self.utterances += 1

    @property
    def waiting(self) -> bool:
        """Whether the caller still waits for an answer: an utterance it said has no reply yet, or one is
        still in progress (this clock's own segmenter: the doors that leave the decision to it)."""
        return bool(self.ends) or self._segmenter.in_speech

    def reply_started(self, out: dict, at: float, turn: int | None = None) -> None:
        """A reply's first audio (to turn `turn`, where the door names it) reached the caller at `at`."""
        end = self.turns.pop(turn, None) if turn is not None else self.ends.popleft() if self.ends else None
        if end is not None:
            decided, real_end = end
            out["v2v_client_ms"].append((at - decided) * 1000)
            out.setdefault("v2v_real_end_ms", []).append((at - real_end) * 1000)
        else:
            out["unmatched_replies"].append(1)


# The longest a caller talks on past its duration, finishing what it is saying.
HANG_UP_LATEST_S = 10.0


def talk_seconds(pcm16k: bytes, start_frame: int, duration_s: float) -> float:
    """How long a caller streaming `pcm16k` (looped from `start_frame`) talks: `duration_s`, then on until
    the daemon's own segmenter (silence detection's settings, the very frames) has no utterance in
    progress, so that hanging up ends no turn. Callers that all hung up at `duration_s` cut every utterance
    in progress at one instant, and the daemon ended all those turns together (a half-close ends the turn
    in progress): a burst no real set of callers makes, which at 128 callers was 49 of a level's 277
    transcripts, every one of its slowest (docs/BENCHMARKS.md)."""
    from voiced.config import Config
    from voiced.core.segmenter import Segmenter
    from voiced.core.spec import segmentation_for

    n_frames = len(pcm16k) // 640
    segmenter = Segmenter(segmentation_for(Config()))
    n, least, latest = 0, round(duration_s / FRAME_S), round((duration_s + HANG_UP_LATEST_S) / FRAME_S)
    while n < latest and (n < least or segmenter.in_speech):
        i = (start_frame + n) % n_frames
        segmenter.push(np.frombuffer(pcm16k, "<i2", 320, i * 640))
        n += 1
    return n * FRAME_S


async def paced(frames: list[bytes], start_frame: int, duration_s: float, send, out: dict) -> None:
    """Send `duration_s` of frames (looped from start_frame) through `send`, one every 20 ms against the
    clock. The count is fixed, not the time: a caller that falls behind (a busy machine) catches up and
    still says all it was to say; one stopped by the clock would hang up mid-utterance, ending a turn
    `talk_seconds` chose not to (counted unanswered when the daemon drops the fragment)."""
    t0 = time.monotonic()
    for n in range(1, round(duration_s / FRAME_S) + 1):
        await send(frames[(start_frame + n - 1) % len(frames)])
        await asyncio.sleep(max(0.0, t0 + n * FRAME_S - time.monotonic()))
        out["late_ms"].append(max(0.0, (time.monotonic() - (t0 + n * FRAME_S)) * 1000))


async def hold_line(silence: bytes, send, waiting, out: dict, limit_s: float = 30.0) -> None:
    """After talking, keep the line open, sending silence as a phone line or an open microphone does, while
    `waiting()` says an answer is still owed (`limit_s` at most): a caller waits for the answer before
    hanging up, and a hang-up ends a phone call, its reply with it."""
    deadline = time.monotonic() + limit_s
    while waiting() and time.monotonic() < deadline:
        await paced([silence], 0, FRAME_S, send, out)


async def audiosocket_caller(address: str, pcm16k: bytes, start_frame: int, duration_s: float, reply_s: float,
                             out: dict) -> None:
    """An Asterisk channel driver call in slin16 (type 0x12): the same samples gRPC callers send."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(struct.pack(">BH", 0x01, 16) + uuid.uuid4().bytes)
    frames = [pcm16k[i : i + 640] for i in range(0, len(pcm16k) - 639, 640)]
    clock = EndOfSpeech()
    per_reply = round(reply_s / FRAME_S)

    async def read():
        received = 0
        try:
            while True:
                kind, length = struct.unpack(">BH", await reader.readexactly(3))
                await reader.readexactly(length)
                if kind == 0x12:
                    if received % per_reply == 0:
                        clock.reply_started(out, time.monotonic())
                    received += 1
                elif kind == 0xFF:
                    out["notices"].append("AudioSocket error message")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def send(frame: bytes):
        writer.write(struct.pack(">BH", 0x12, len(frame)) + frame)
        clock.sent(frame, time.monotonic())
        await writer.drain()

    reading = asyncio.create_task(read())
    await paced(frames, start_frame, duration_s, send, out)
    await hold_line(bytes(640), send, lambda: clock.waiting, out)
    out["unanswered"].append(len(clock.ends))
    writer.write(b"\x00\x00\x00")  # hang up
    await writer.drain()
    await reading
    writer.close()


async def media_ws_caller(address: str, pcm16k: bytes, start_frame: int, duration_s: float, out: dict) -> None:
    """A Twilio Media Streams call: mu-law 8 kHz in base64 JSON, marks answered as Twilio does."""
    import aiohttp
    import soxr

    from voiced.audio.ingest import Format, encode_pcm, float_to_int16

    x = np.frombuffer(pcm16k, "<i2").astype(np.float32) / 32768.0
    mulaw = encode_pcm(float_to_int16(soxr.resample(x, 16000, 8000)), "MULAW")
    frames = [mulaw[i : i + 160] for i in range(0, len(mulaw) - 159, 160)]
    clock = EndOfSpeech(Format("MULAW", 8000))
    sid = "MZ" + uuid.uuid4().hex
    async with aiohttp.ClientSession() as http, http.ws_connect(f"ws://{address}/media") as ws:
        await ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send_str(json.dumps({"event": "start", "streamSid": sid, "start": {
            "streamSid": sid, "callSid": "CA" + uuid.uuid4().hex, "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))

        async def read():
            in_reply = False
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                event = json.loads(msg.data)
                if event["event"] == "media" and not in_reply:
                    in_reply = True
                    clock.reply_started(out, time.monotonic())
                elif event["event"] == "mark":
                    in_reply = False
                    await ws.send_str(json.dumps({"event": "mark", "streamSid": sid, "mark": event["mark"]}))

        chunk = [0]

        async def send(frame: bytes):
            chunk[0] += 1
            clock.sent(frame, time.monotonic())  # as it goes out: the send may wait
            await ws.send_str(json.dumps({"event": "media", "streamSid": sid, "media": {
                "track": "inbound", "chunk": str(chunk[0]), "payload": base64.b64encode(frame).decode()}}))

        reading = asyncio.create_task(read())
        await paced(frames, start_frame, duration_s, send, out)
        await hold_line(encode_pcm(np.zeros(160, np.int16), "MULAW"), send, lambda: clock.waiting, out)
        out["unanswered"].append(len(clock.ends))
        await ws.send_str(json.dumps({"event": "stop", "streamSid": sid, "stop": {}}))
        await reading
