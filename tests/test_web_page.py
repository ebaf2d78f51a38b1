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
