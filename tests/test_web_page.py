"""The page at `/` in a real browser: Debian's chromium driven by Playwright, its fake microphone fed
from an espeak-ng WAV. The page captures it with an AudioWorklet at 24 kHz, streams it to
/v1/realtime, shows the phrase's transcript and the agent's words, and plays the reply."""

from __future__ import annotations

import shutil
import threading

import pytest

from tests.http_harness import base_url, make_models, start_http_daemon
from tests.speech import layout, write_wav

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; `make system-deps` does it)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")


def chromium_args(wav) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={wav}%noloop",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
            "--autoplay-policy=no-user-gesture-required"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon(make_models(tmp_path_factory), tmp_path_factory.mktemp("voices"))
    yield d
    d.stop()


class HeardTranscripts:
    """What the recognizer returned, recorded at the engine (the real engine runs; this only looks)."""

    def __init__(self, engine):
        self.texts: list[str] = []
        self._lock = threading.Lock()
        self._step = engine.step
        engine.step = self

    def __call__(self):
        outputs = self._step()
        with self._lock:
            self.texts += [o.value.text.strip() for o in outputs if o.final and o.value is not None]
        return outputs


def test_the_page_shows_the_transcript_and_plays_the_reply(daemon, tmp_path):
    lay = layout(["Hello, I would like to book a table for two."], lead_s=0.8, tail_s=2.5)
    wav = write_wav(tmp_path / "mic.wav", lay.audio)
    heard = HeardTranscripts(daemon.services.asr.engine)
    console: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=chromium_args(wav))
        try:
            page = browser.new_page()
            page.on("console", lambda m: console.append(m.text))
            page.goto(base_url(daemon) + "/")
            assert page.title() == "voiced"
            page.click("#connect")
            page.wait_for_selector("#status[data-state=live]", timeout=60_000)
            final = page.wait_for_selector(".turn.heard .final", timeout=120_000)
            page.wait_for_function("Number(document.body.dataset.played || 0) > 2400", timeout=120_000)
            timing = page.wait_for_selector(".turn[data-v2v]", timeout=60_000)
            shown = final.text_content()
            agent = page.text_content(".turn.heard .agent .text")
            v2v = int(timing.get_attribute("data-v2v"))
            page.screenshot(path=str(tmp_path / "page.png"))
        finally:
            browser.close()
    assert shown and shown in heard.texts, (shown, heard.texts, console)
    assert agent == shown  # the echo agent says what it heard
    assert v2v > 0


def test_push_to_talk_in_the_page(daemon, tmp_path):
    lay = layout(["Please call me back tomorrow morning."], lead_s=0.3, tail_s=0.3)
    wav = write_wav(tmp_path / "loop.wav", lay.audio)
    heard = HeardTranscripts(daemon.services.asr.engine)
    args = [a for a in chromium_args(wav) if not a.startswith("--use-file")]
    args.append(f"--use-file-for-fake-audio-capture={wav}")  # looped: whenever the button goes down, it talks
    loop_samples = len(lay.audio) * 24000 // 16000
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page()
            page.goto(base_url(daemon) + "/")
            page.uncheck("#handsfree")
            page.click("#connect")
            page.wait_for_selector("#talk:not([disabled])", timeout=60_000)
            page.hover("#talk")
            page.mouse.down()
            page.wait_for_function(f"Number(document.body.dataset.sent || 0) >= {loop_samples}", timeout=60_000)
            page.mouse.up()
            final = page.wait_for_selector(".turn.heard .final", timeout=120_000)
            page.wait_for_function("Number(document.body.dataset.played || 0) > 2400", timeout=120_000)
            shown = final.text_content()
            agent = page.text_content(".turn.heard .agent .text")
        finally:
            browser.close()
    assert shown and shown in heard.texts and agent == shown


# ------------------------------------------------------------------ a reply after the next turn began


class ScriptedRealtime:
    """The page's routes and a /v1/realtime that plays a fixed script of server events, in a thread: the
    order of events a slow reply gives (its response starts after the caller began the next turn), which a
    live daemon gives only by chance."""

    def __init__(self, script: list[dict]):
        import asyncio

        from aiohttp import web

        from voiced.doors import web as page

        self.script = script
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes(page.routes())
        app.add_routes([web.get("/v1/models", self._models), web.get("/v1/realtime", self._realtime)])
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "tiny", "kind": "transcription"},
                                                             {"id": "spark", "kind": "speech"}]})

    async def _realtime(self, request):
        import asyncio
        import json

        from aiohttp import web

        ws = web.WebSocketResponse(protocols=["realtime"])
        await ws.prepare(request)
        await ws.receive()  # the page's session.update
        await ws.send_str(json.dumps({"type": "session.updated", "session": {}}))
        for event in self.script:
            await asyncio.sleep(0.05)
            await ws.send_str(json.dumps(event))
        async for _ in ws:
            pass
        return ws

    def stop(self):
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _turn(item: str, text: str) -> list[dict]:
    return [{"type": "input_audio_buffer.speech_started", "item_id": item, "audio_start_ms": 0},
            {"type": "input_audio_buffer.speech_stopped", "item_id": item, "audio_end_ms": 900},
            {"type": "input_audio_buffer.committed", "item_id": item},
            {"type": "conversation.item.input_audio_transcription.completed", "item_id": item, "transcript": text}]


def _reply(resp: str, answers: str, text: str) -> list[dict]:
    response = {"id": resp, "status": "in_progress", "metadata": {"item_id": answers}}
    return [{"type": "response.created", "response": response},
            {"type": "response.output_audio_transcript.delta", "response_id": resp, "delta": text},
            {"type": "response.done", "response": {**response, "status": "completed"}}]


def test_a_reply_that_arrives_after_the_next_turn_began_goes_to_its_own_turn(tmp_path):
    first, second = _turn("item_1", "what time is it"), _turn("item_2", "and the date")
    script = (first + second[:1]  # the caller speaks again before the first reply starts
              + _reply("resp_1", "item_1", "it is noon") + second[1:] + _reply("resp_2", "item_2", "the first"))
    server = ScriptedRealtime(script)
    wav = write_wav(tmp_path / "quiet.wav", layout(["Hello."], lead_s=0.1, tail_s=0.1).audio * 0)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=chromium_args(wav))
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.port}/")
                page.click("#connect")
                page.wait_for_function("document.querySelectorAll('.turn.heard').length == 2 && "
                                       "document.querySelector('.turn[data-item=item_2] .agent .text').textContent",
                                       timeout=30_000)
                agents = {item: page.text_content(f".turn[data-item={item}] .agent .text")
                          for item in ("item_1", "item_2")}
            finally:
                browser.close()
    finally:
        server.stop()
    assert agents == {"item_1": "it is noon", "item_2": "the first"}


# ------------------------------------------------------------------ a server that only listens


def test_a_listening_only_server_says_so_and_offers_no_voice(tmp_path_factory):
    from tests.daemon_harness import start_daemon
    from tests.http_harness import http_config

    whisper, _ = make_models(tmp_path_factory)
    config = http_config()
    config.tts.enabled = False
    d = start_daemon(whisper, config)
    d.services.tts_off = "this server only listens: it has no speech synthesis model. Spark-TTS (not in the cache)"
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(base_url(d) + "/")
                note = page.wait_for_selector("#listening-only:not([hidden])", timeout=30_000)
                said = note.text_content()
                picker_visible = page.is_visible("#voice-picker")
            finally:
                browser.close()
    finally:
        d.stop()
    assert "only listens" in said and "no reply is spoken" in said and "Spark-TTS (not in the cache)" in said, said
    assert not picker_visible
