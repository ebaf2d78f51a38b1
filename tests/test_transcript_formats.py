"""OpenAI's transcription response formats, rendered from per-utterance transcripts on the clip's clock."""

from __future__ import annotations

import json

from tests.openai_models import strict
from voiced.doors.transcripts import Recognized, render, timed_segments
from voiced.engines.base import Segment, Transcript


def _t(text, segments=(), language="en"):
    return Transcript(text=text, language=language, tokens=[1, 2], avg_logprob=-0.2, no_speech_prob=0.01,
                      compression_ratio=1.1, segments=list(segments))


RESULTS = [
    Recognized(0.5, 3.0, _t(" Hello there. How are you?", [Segment(0.0, 1.2, " Hello there.", [1]),
                                                            Segment(1.2, 2.5, " How are you?", [2])])),
    # No timestamp tokens came back: the utterance is the segment.
    Recognized(3661.25, 3663.0, _t(" Fine, thanks.")),
]


def test_segments_are_placed_on_the_clip_clock():
    segs = timed_segments(RESULTS)
    assert [(s.id, s.start, s.end, s.text) for s in segs] == [
        (0, 0.5, 1.7, "Hello there."), (1, 1.7, 3.0, "How are you?"), (2, 3661.25, 3663.0, "Fine, thanks.")]


def test_a_timestamp_past_the_utterance_keeps_its_segment_inside_it():
    late = [Recognized(2.0, 8.0, _t(" a b", [Segment(0.5, 1.0, " a", [1]), Segment(16.66, 16.66, " b", [2])]))]
    assert [(s.start, s.end) for s in timed_segments(late)] == [(2.5, 3.0), (8.0, 8.0)]


def test_srt_and_vtt():
    srt, ctype = render(RESULTS, "srt", task="transcribe", duration=3664.0, language=None)
    assert ctype.startswith("application/x-subrip")
    assert srt == ("1\n00:00:00,500 --> 00:00:01,700\nHello there.\n\n"
                   "2\n00:00:01,700 --> 00:00:03,000\nHow are you?\n\n"
                   "3\n01:01:01,250 --> 01:01:03,000\nFine, thanks.\n\n")
    vtt, ctype = render(RESULTS, "vtt", task="transcribe", duration=3664.0, language=None)
    assert ctype.startswith("text/vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.500 --> 00:00:01.700\nHello there.\n\n")
    assert "01:01:01.250 --> 01:01:03.000\nFine, thanks.\n\n" in vtt


def test_json_text_and_verbose_json_parse_as_the_sdk_types():
    from openai.types.audio import Transcription, TranscriptionVerbose, Translation

    body, _ = render(RESULTS, "json", task="transcribe", duration=3664.0, language=None)
    assert strict(Transcription, json.loads(body)).text == "Hello there. How are you? Fine, thanks."
    body, _ = render(RESULTS, "json", task="translate", duration=3664.0, language=None)
    assert strict(Translation, json.loads(body)).text == "Hello there. How are you? Fine, thanks."
    text, ctype = render(RESULTS, "text", task="transcribe", duration=3664.0, language=None)
    assert text == "Hello there. How are you? Fine, thanks.\n" and ctype.startswith("text/plain")
    body, _ = render(RESULTS, "verbose_json", task="transcribe", duration=3664.0, language=None)
    v = strict(TranscriptionVerbose, {k: w for k, w in json.loads(body).items() if k != "task"})
    assert v.language == "english" and v.duration == 3664.0 and len(v.segments) == 3
    assert v.segments[2].start == 3661.25 and v.segments[2].seek == 366125
    assert json.loads(body)["task"] == "transcribe"


def test_an_empty_result_is_an_empty_transcript_not_an_error():
    body, _ = render([], "verbose_json", task="transcribe", duration=1.0, language="de")
    assert json.loads(body)["segments"] == [] and json.loads(body)["language"] == "german"
    assert render([], "srt", task="transcribe", duration=1.0, language=None)[0] == ""
