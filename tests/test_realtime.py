"""`/v1/realtime` driven by the official `openai` SDK's Realtime client: espeak-ng speech in, its
transcript and the agent's spoken reply out, every server event checked against the SDK's own models.
A real daemon with tiny random Whisper and Spark-TTS checkpoints and the echo agent."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import pytest
from voiced_client.proto import voiced_pb2 as pb

from tests.daemon_harness import (
    FAULT_TEXT,
    audio_requests,
    collector_off,
    engine_fault,
    of_kind,
    session_config,
    stream_blocking,
    wire_audio,
)
from tests.http_harness import REPLY_S, base_url, http_config, make_models, start_http_daemon
from tests.openai_models import server_event
from tests.speech import layout
from tests.until import until
from voiced.audio.ingest import Format

openai = pytest.importorskip("openai")
pytest.importorskip("websockets", reason="the openai SDK's Realtime client runs on websockets")

PCM24 = Format("LINEAR16", 24000)
PHONE = Format("MULAW", 8000)
CHUNK_MS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def daemon(models, tmp_path_factory):
    d = start_http_daemon(models, tmp_path_factory.mktemp("voices"))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def speech():
    lay = layout(["Hello, I would like to book a table for two."], lead_s=0.3, tail_s=1.0)
    return lay.audio


class Conn:
    """The SDK's connection, with every event it receives kept, checked strictly and parsed by the SDK."""

    def __init__(self, conn):
        self.conn = conn
        self.events: list = []  # SDK-parsed, in order

    async def recv(self):
        raw = await asyncio.wait_for(self.conn.recv_bytes(), 120)
        server_event(json.loads(raw))
        event = self.conn.parse_event(raw)
        self.events.append(event)
        return event

    async def until(self, *types: str):
        while True:
            event = await self.recv()
            if event.type in types:
                return event

    async def send_audio(self, data: bytes, fmt: Format) -> None:
        step = fmt.bytes_per_sample * fmt.sample_rate * CHUNK_MS // 1000
        for i in range(0, len(data), step):
            await self.conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + step]).decode())

    def of(self, kind: str) -> list:
        return [e for e in self.events if e.type == kind]


def session(fmt: str = "audio/pcm", turn_detection: dict | None = "server_vad", **kw) -> dict:
    f = {"type": fmt, "rate": 24000} if fmt == "audio/pcm" else {"type": fmt}
    td = {"type": "server_vad"} if turn_detection == "server_vad" else turn_detection
    return {"type": "realtime", "audio": {"input": {"format": f, "turn_detection": td},
                                         "output": {"format": f, "voice": "female"}}, **kw}


async def connect(daemon, fn, *, intent: str | None = None, api_key: str = "unused"):
    url = base_url(daemon)
    async with openai.AsyncOpenAI(base_url=url + "/v1", websocket_base_url=url.replace("http", "ws") + "/v1",
                                  api_key=api_key, max_retries=0) as client:
        async with client.realtime.connect(model="voiced", extra_query={"intent": intent} if intent else {}) as c:
            return await fn(Conn(c))


def expected_transcript(daemon, data: bytes, fmt: Format) -> str:
    """The same audio through gRPC StreamingRecognize: the same core, another door."""
    events, code, details = stream_blocking(daemon.address, audio_requests(session_config(fmt), data, fmt))
    assert code == grpc.StatusCode.OK, details
    [final] = [e.transcript.text for e in of_kind(events, "transcript") if e.transcript.is_final]
    return final.strip()


def test_a_spoken_phrase_gets_its_transcript_and_a_spoken_reply(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        created = await c.recv()
        assert created.type == "session.created" and created.session.type == "realtime"
        await c.conn.session.update(session=session(instructions="Answer briefly."))
        updated = await c.until("session.updated")
        await c.send_audio(data, PCM24)
        await c.until("response.done")
        return updated, c

    updated, c = asyncio.run(connect(daemon, go))
    s = updated.session
    assert s.instructions == "Answer briefly." and s.audio.output.voice == "female"
    assert s.audio.input.turn_detection.type == "server_vad" and s.audio.input.format.rate == 24000
    types = [e.type for e in c.events]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
             "conversation.item.input_audio_transcription.completed", "response.created",
             "response.output_audio_transcript.delta", "response.output_audio.delta", "response.output_audio.done",
             "response.output_audio_transcript.done", "response.done"]
    assert all(t in types for t in order) and sorted(order, key=types.index) == order, types
    [started], [stopped] = c.of("input_audio_buffer.speech_started"), c.of("input_audio_buffer.speech_stopped")
    assert 0 < started.audio_start_ms < stopped.audio_end_ms <= len(speech) * 1000 // 16000
    [heard] = c.of("conversation.item.input_audio_transcription.completed")
    assert heard.item_id == started.item_id == stopped.item_id
    assert heard.transcript == expected_transcript(daemon, data, PCM24)
    said = "".join(d.delta for d in c.of("response.output_audio_transcript.delta"))
    assert said == heard.transcript  # the echo agent
    [done] = c.of("response.output_audio_transcript.done")
    assert done.transcript == said
    audio = b"".join(base64.b64decode(d.delta) for d in c.of("response.output_audio.delta"))
    assert 0.1 < len(audio) / 2 / 24000 <= REPLY_S + 0.05
    [response] = c.of("response.done")
    assert response.response.status == "completed"
    assert response.response.output[0].content[0].transcript == said
    deltas = c.of("response.output_audio.delta")
    assert {d.response_id for d in deltas} == {response.response.id}
    # The response names the user item it answers (the page attaches a late reply to its own turn by it).
    [created] = c.of("response.created")
    assert created.response.metadata == {"item_id": heard.item_id}
    assert response.response.metadata == {"item_id": heard.item_id}


def test_speech_over_a_reply_cancels_it(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        await c.send_audio(data, PCM24)
        await c.until("response.output_audio.delta")
        await c.send_audio(data, PCM24)  # the caller talks over the reply
        done = await c.until("response.done")
        await c.until("conversation.item.input_audio_transcription.completed")
        return done, c

    done, c = asyncio.run(connect(daemon, go))
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
    assert len(c.of("input_audio_buffer.speech_started")) == 2


def test_response_cancel_stops_the_reply(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        await c.send_audio(data, PCM24)
        await c.until("response.output_audio.delta")
        await c.conn.response.cancel()
        return await c.until("response.done")

    done = asyncio.run(connect(daemon, go))
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"


def test_push_to_talk_with_commit_and_clear(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session(turn_detection=None))
        updated = await c.until("session.updated")
        assert updated.session.audio.input.turn_detection is None
        await c.send_audio(data[: len(data) // 3], PCM24)
        await c.conn.input_audio_buffer.clear()
        await c.until("input_audio_buffer.cleared")
        await c.conn.input_audio_buffer.commit()
        empty = await c.until("error")
        await c.send_audio(data, PCM24)
        await c.conn.input_audio_buffer.commit()
        committed = await c.until("input_audio_buffer.committed")
        heard = await c.until("conversation.item.input_audio_transcription.completed")
        await c.until("response.done")
        return empty, committed, heard, c

    empty, committed, heard, c = asyncio.run(connect(daemon, go))
    assert empty.error.code == "input_audio_buffer_commit_empty"
    assert heard.item_id == committed.item_id
    assert not c.of("input_audio_buffer.speech_started")  # no VAD events without server_vad
    # Push-to-talk hears exactly what was committed: the gRPC door with the same marks hears the same.
    requests = [pb.SessionRequest(config=session_config(PCM24, segmentation=pb.SegmentationConfig(
        mode=pb.PUSH_TO_TALK))), pb.SessionRequest(control=pb.Control(talk_start=pb.TalkStart())),
        pb.SessionRequest(audio=data), pb.SessionRequest(control=pb.Control(talk_end=pb.TalkEnd()))]
    events, code, _ = stream_blocking(daemon.address, requests)
    assert [e.transcript.text.strip() for e in of_kind(events, "transcript") if e.transcript.is_final] == \
        [heard.transcript]


def test_phone_audio_in_and_out(daemon, speech):
    data = wire_audio(speech, PHONE)

    async def go(c: Conn):
        await c.conn.session.update(session=session("audio/pcmu"))
        await c.until("session.updated")
        await c.send_audio(data, PHONE)
        await c.until("response.done")
        return c

    c = asyncio.run(connect(daemon, go))
    [heard] = c.of("conversation.item.input_audio_transcription.completed")
    assert heard.transcript == expected_transcript(daemon, data, PHONE)
    audio = b"".join(base64.b64decode(d.delta) for d in c.of("response.output_audio.delta"))
    assert 0.1 < len(audio) / 8000 <= REPLY_S + 0.05  # one byte per sample: G.711 at 8 kHz


def test_intent_transcription_transcribes_only(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        created = await c.recv()
        assert created.session.type == "transcription"
        await c.conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": {"type": "server_vad"}}}})
        await c.until("session.updated")
        await c.send_audio(data, PCM24)
        heard = await c.until("conversation.item.input_audio_transcription.completed")
        await c.conn.response.create()
        refused = await c.until("error")
        return heard, refused, c

    heard, refused, c = asyncio.run(connect(daemon, go, intent="transcription"))
    assert heard.transcript == expected_transcript(daemon, data, PCM24)
    assert refused.error.code == "invalid_event"
    assert not [e for e in c.events if e.type.startswith("response.")]


def test_bad_events_get_errors_and_the_connection_goes_on(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        ws = c.conn._connection  # the SDK sends only well-formed events: bad ones go in by hand
        errors = []
        await c.conn.input_audio_buffer.append(audio=base64.b64encode(data[:960]).decode())
        errors.append(await c.until("error"))  # audio before session.update
        for raw in ('{"type": "hello"}', '{"type": "input_audio_buffer.append"}', "not json",
                    '{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/opus"}}}}}',
                    '{"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}}',
                    '{"type": "conversation.item.truncate", "item_id": "x", "content_index": 0, "audio_end_ms": 0}'):
            await ws.send(raw)
            errors.append(await c.until("error"))
        await ws.send(b"\x00\x01")
        errors.append(await c.until("error"))
        await c.conn.session.update(session=session())  # and it still works
        await c.until("session.updated")
        await c.send_audio(data, PCM24)
        await c.until("conversation.item.input_audio_transcription.completed")
        return errors

    errors = asyncio.run(connect(daemon, go))
    assert [(e.error.code, e.error.param) for e in errors] == [
        ("session_not_configured", "type"), ("unknown_event_type", "type"),
        ("missing_required_parameter", "event.audio"), ("invalid_json", None),
        ("invalid_value", "session.audio.input.format.type"), ("voice_not_found", "session.audio.output.voice"),
        ("unsupported_event", "type"), ("binary_frames_not_supported", None)]
    assert all(e.error.message for e in errors)


def test_a_closed_connection_leaves_nothing_behind(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        await c.send_audio(data, PCM24)
        await c.until("response.output_audio.delta")  # leave in the middle of a reply

    async def settled():
        for _ in range(500):
            tasks = [t for t in asyncio.all_tasks() if ":" in t.get_name()]
            if not tasks and daemon.services.active_sessions == 0:
                return []
            await asyncio.sleep(0.01)
        return [t.get_name() for t in tasks]

    with collector_off() as new_call_objects:
        asyncio.run(connect(daemon, go))
        assert daemon.call(settled) == []
        # not even in a reference cycle, for the collector's next full pass (tests/test_conversation.py)
        until(lambda: not new_call_objects(), "the call's objects to be freed", timeout_s=10, interval_s=0.05)
    assert daemon.services.asr.pending == 0 and daemon.services.tts.pending == 0


def test_over_capacity_is_an_error_and_a_try_again_close(models, tmp_path):
    import websockets

    config = http_config(max_sessions=1)
    d = start_http_daemon(models, tmp_path / "voices", config)
    try:
        async def go():
            url = base_url(d).replace("http", "ws") + "/v1/realtime?model=voiced"
            async with websockets.connect(url) as first:
                assert json.loads(await first.recv())["type"] == "session.created"
                async with websockets.connect(url) as second:
                    refused = json.loads(await second.recv())
                    with pytest.raises(websockets.ConnectionClosed) as closed:
                        await second.recv()
                    return refused, closed.value.rcvd.code

        refused, code = asyncio.run(go())
        server_event(refused)
        assert refused["error"]["code"] == "over_capacity" and "max_sessions" in refused["error"]["message"]
        assert code == 1013
    finally:
        d.stop()


def test_the_token_on_the_upgrade_request(models, tmp_path):
    import websockets

    config = http_config(auth_token="s3cret")
    config.tts.enabled = False
    d = start_http_daemon(models, tmp_path / "voices", config)
    try:
        async def sdk(c: Conn):
            return (await c.recv()).type

        assert asyncio.run(connect(d, sdk, api_key="s3cret")) == "session.created"
        with pytest.raises(Exception) as e:
            asyncio.run(connect(d, sdk, api_key="wrong"))
        assert "401" in str(e.value)

        async def browser_style():  # a browser cannot set headers: the token rides as a subprotocol
            url = base_url(d).replace("http", "ws") + "/v1/realtime"
            async with websockets.connect(url, subprotocols=["realtime", "openai-insecure-api-key.s3cret"]) as ws:
                assert ws.subprotocol == "realtime"
                return json.loads(await ws.recv())["type"]

        assert asyncio.run(browser_style()) == "session.created"
    finally:
        d.stop()


def test_drain_closes_open_connections_as_going_away(models, tmp_path):
    import websockets

    d = start_http_daemon(models, tmp_path / "voices")
    url = base_url(d).replace("http", "ws") + "/v1/realtime?model=voiced"

    async def go():
        async with websockets.connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            stopping = asyncio.ensure_future(asyncio.to_thread(d.stop))  # drain with no grace
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            await stopping
            return closed.value.rcvd.code

    assert asyncio.run(go()) == 1001


def test_partial_transcripts_from_a_streaming_transcription_model(daemon):
    lay = layout(["The quick brown fox jumps over the lazy dog, and then it runs away."], lead_s=0.3, tail_s=0.0)
    data = wire_audio(lay.audio, PCM24)
    silence = bytes(2 * 24000)  # one second: the end of the turn

    async def go(c: Conn):
        s = session()
        s["audio"]["input"]["transcription"] = {"model": "gpt-4o-transcribe", "language": "en"}
        await c.conn.session.update(session=s)
        updated = await c.until("session.updated")
        assert updated.session.audio.input.transcription.model == "gpt-4o-transcribe"
        await c.send_audio(data, PCM24)  # still speaking: partials come meanwhile
        partial = await c.until("conversation.item.input_audio_transcription.delta")
        await c.send_audio(silence, PCM24)
        final = await c.until("conversation.item.input_audio_transcription.completed")
        return partial, final

    partial, final = asyncio.run(connect(daemon, go))
    assert partial.item_id == final.item_id and partial.delta


def test_a_message_over_the_size_limit_closes_the_connection(daemon):
    import websockets

    async def go():
        url = base_url(daemon).replace("http", "ws") + "/v1/realtime"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.recv()
            too_big = daemon.services.config.server.max_message_bytes + 1
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * too_big}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            return closed.value.rcvd.code

    assert asyncio.run(go()) == 1009


def _typed(c: Conn, text: str):
    return c.conn.conversation.item.create(item={"type": "message", "role": "user",
                                                 "content": [{"type": "input_text", "text": text}]})


def test_typed_text_gets_a_spoken_answer(daemon):
    async def go(c: Conn):
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        await _typed(c, "What time is it?")
        added = await c.until("conversation.item.added")
        item_done = await c.until("conversation.item.done")
        asked_at = len(c.events)  # typed text waits for response.create, even with server_vad on
        await c.conn.response.create()
        done = await c.until("response.done")
        return added, item_done, asked_at, done, c

    added, item_done, asked_at, done, c = asyncio.run(connect(daemon, go))
    assert added.item.role == "user" and added.item.content[0].type == "input_text"
    assert added.item.content[0].text == item_done.item.content[0].text == "What time is it?"
    assert added.item.id == item_done.item.id
    types = [e.type for e in c.events]
    assert types.index("response.created") >= asked_at
    order = ["response.created", "response.output_audio_transcript.delta", "response.output_audio.delta",
             "response.output_audio.done", "response.output_audio_transcript.done", "response.done"]
    assert sorted(order, key=types.index) == order, types
    said = "".join(d.delta for d in c.of("response.output_audio_transcript.delta"))
    assert said == "What time is it?" and done.response.status == "completed"  # the echo agent
    assert done.response.output[0].content[0].transcript == said
    audio = b"".join(base64.b64decode(d.delta) for d in c.of("response.output_audio.delta"))
    assert 0.1 < len(audio) / 2 / 24000 <= REPLY_S + 0.05
    assert not c.of("input_audio_buffer.speech_started")  # nothing was heard: the text was the turn


def test_a_typed_texts_reply_is_cancelled_and_talked_over_as_a_spoken_one(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        await _typed(c, "Tell me a story.")
        await c.conn.response.create()
        await c.until("response.output_audio.delta")
        await c.conn.response.cancel()
        cancelled = await c.until("response.done")
        await _typed(c, "Tell me another one.")
        await c.conn.response.create()
        await c.until("response.output_audio.delta")
        await c.send_audio(data, PCM24)  # the caller talks over the reply
        talked_over = await c.until("response.done")
        heard = await c.until("conversation.item.input_audio_transcription.completed")
        answered = await c.until("response.done")  # and what they said is answered in turn
        return cancelled, talked_over, heard, answered, c

    cancelled, talked_over, heard, answered, c = asyncio.run(connect(daemon, go))
    assert cancelled.response.status == "cancelled" and cancelled.response.status_details.reason == "client_cancelled"
    assert cancelled.response.output[0].content[0].transcript == "Tell me a story."
    assert talked_over.response.status == "cancelled" and talked_over.response.status_details.reason == "turn_detected"
    assert answered.response.status == "completed"
    assert answered.response.output[0].content[0].transcript == heard.transcript


def test_bad_typed_text_gets_errors_and_the_connection_goes_on(daemon):
    from voiced.core.spec import MAX_TEXT_CHARS

    WAITING = ("word " * (MAX_TEXT_CHARS // 10)).strip()  # half the limit

    def item(*content, role="user", kind="message") -> str:
        return json.dumps({"type": "conversation.item.create", "event_id": "mine",
                           "item": {"type": kind, "role": role, "content": list(content)}})

    async def go(c: Conn):
        ws = c.conn._connection  # the SDK would send these too, but its types say what is well formed
        await c.conn.session.update(session=session())
        await c.until("session.updated")
        errors = []
        for raw in (item({"type": "input_text", "text": "  "}),
                    item({"type": "input_text", "text": "\u0000\u0007"}),
                    item({"type": "input_text", "text": "x" * (MAX_TEXT_CHARS + 1)}),
                    item({"type": "input_audio", "audio": "AAAA"}),
                    item({"type": "input_text"}),
                    item({"type": "input_text", "text": "Be terse."}, role="system"),
                    item(kind="function_call_output")):
            await ws.send(raw)
            errors.append(await c.until("error"))
        # Waiting text counts towards the limit: what one response.create would hand the agent.
        await _typed(c, WAITING)
        await c.until("conversation.item.done")
        await ws.send(item({"type": "input_text", "text": "more " * (MAX_TEXT_CHARS // 10 + 1)}))
        errors.append(await c.until("error"))
        await c.conn.response.create()  # and it still works: the waiting text is answered
        done = await c.until("response.done")
        return errors, done, c

    errors, done, c = asyncio.run(connect(daemon, go))
    assert [(e.error.code, e.error.param) for e in errors] == [
        ("invalid_value", "item.content"), ("invalid_value", "item.content"),
        ("string_above_max_length", "item.content"), ("unsupported_content", "item.content[0].type"),
        ("missing_required_parameter", "item.content[0].text"), ("unsupported_item", "item.role"),
        ("unsupported_item", "item.type"), ("string_above_max_length", "item.content")]
    assert all(e.error.message and e.error.event_id == "mine" for e in errors)
    assert "at most 4000" in errors[2].error.message and "waiting for response.create" in errors[-1].error.message
    assert done.response.status == "completed"
    said = "".join(d.delta for d in c.of("response.output_audio_transcript.delta"))
    assert said == WAITING
    assert len(c.of("conversation.item.added")) == 2  # the typed item and the reply: nothing bad was added


def test_an_engine_fault_is_a_server_error_without_its_text_and_the_connection_goes_on(daemon, speech):
    data = wire_audio(speech, PCM24)

    async def go(c: Conn):
        await c.conn.session.update(session=session(turn_detection=None))
        await c.until("session.updated")
        with engine_fault(daemon.services.asr.engine):  # the turn's recognition fails
            await c.send_audio(data, PCM24)
            await c.conn.input_audio_buffer.commit()
            heard_fault = await c.until("error")
        with engine_fault(daemon.services.tts.engine):  # the reply's speech fails
            await _typed(c, "What time is it?")
            await c.conn.response.create()
            spoken_fault = await c.until("error")
            failed = await c.until("response.done")
        await c.send_audio(data, PCM24)  # and the connection goes on
        await c.conn.input_audio_buffer.commit()
        heard = await c.until("conversation.item.input_audio_transcription.completed")
        await c.until("response.done")
        return heard_fault, spoken_fault, failed, heard

    heard_fault, spoken_fault, failed, heard = asyncio.run(connect(daemon, go))
    assert (heard_fault.error.type, heard_fault.error.code) == ("server_error", "asr_failed")
    assert (spoken_fault.error.type, spoken_fault.error.code) == ("server_error", "tts_failed")
    assert failed.response.status == "failed"
    for text in (heard_fault.error.message, spoken_fault.error.message, json.dumps(failed.response.to_dict())):
        assert FAULT_TEXT not in text and "RuntimeError" not in text
    assert "server log" in heard_fault.error.message
    assert heard.item_id  # the next turn was heard


def test_a_turn_whose_words_are_dropped_completes_its_item_empty_and_gets_no_response(models, tmp_path, speech):
    """Thresholds that judge every result a hallucination (Whisper's words on a cough or noise): the turn was
    committed, so its transcription fails saying what was dropped and why, its user item is done with an empty
    transcript (a client waiting on it moves on), and no response follows; the next turn goes the same way,
    and the connection stays open."""
    config = http_config()
    config.asr.no_speech_threshold, config.asr.logprob_threshold = -1.0, 0.0
    d = start_http_daemon(models, tmp_path, config)
    data = wire_audio(speech, PCM24)
    try:
        async def go(c: Conn):
            await c.until("session.created")
            await c.conn.session.update(session=session())
            await c.until("session.updated")
            done = []
            for _ in range(2):
                await c.send_audio(data, PCM24)
                done.append(await c.until("conversation.item.done"))
            await asyncio.sleep(1.0)  # a response would have started by now
            await c.conn.session.update(session=session(instructions="Still here."))
            await c.until("session.updated")
            return done, c

        done, c = asyncio.run(connect(d, go))
    finally:
        d.stop()
    committed = [e.item_id for e in c.of("input_audio_buffer.committed")]
    failed = c.of("conversation.item.input_audio_transcription.failed")
    assert len(committed) == 2 and [e.item_id for e in failed] == committed
    assert c.of("conversation.item.input_audio_transcription.completed") == []
    for e in failed:  # what was dropped and why, as the log says it
        assert e.error.code == "likely_hallucination" and "as a likely hallucination: no-speech probability" \
            in e.error.message and "under 0" in e.error.message, e.error
    assert [e.item.id for e in done] == committed and all(e.item.content[0].transcript == "" for e in done)
    assert c.of("response.created") == []
    assert d.services.metrics.transcripts_dropped._value.get() == 2
