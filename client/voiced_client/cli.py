"""`voiced-client`: stream a file, talk from the microphone, or load a server.

`main(argv) -> int` is callable in-process (the daemon's end-to-end tests run `file` through it); it
blocks (and `load` runs its own event loop), so async callers use `await asyncio.to_thread(main, argv)`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from . import __version__
from .audio import AudioFormat, Encoding
from .connect import DEFAULT_SERVER, Target, describe_rpc_error
from .errors import ClientError
from .wavio import WavError

log = logging.getLogger("voiced_client")


# ------------------------------------------------------------------------------------ arguments


def _spans(text: str) -> list[tuple[float, float]]:
    """`0.5-1.8,2.5-4` -> [(0.5, 1.8), (2.5, 4.0)] (seconds)."""
    try:
        spans = []
        for part in text.split(","):
            a, b = part.split("-")
            spans.append((float(a), float(b)))
        return spans
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START-END[,START-END...] in seconds, got {text!r}") from None


def _add_connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT", help="default %(default)s")
    p.add_argument("--token", help="bearer token (sent as `authorization: Bearer TOKEN`)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca", metavar="FILE", help="PEM root certificate(s) to trust (with --tls)")


def _add_session(p: argparse.ArgumentParser) -> None:
    p.add_argument("--language", default="", help="e.g. en (default: detect per utterance)")
    p.add_argument("--interim", action="store_true", help="ask for interim results (live captions)")
    p.add_argument("--vad-only", action="store_true", help="switch transcription off: speech events only")
    p.add_argument("--hangover-ms", type=int, help="silence that ends an utterance (server default)")
    p.add_argument("--session-id", default="", help="a label for the server's logs and events")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voiced-client", description="Clients for the voiced daemon.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    f = sub.add_parser("file", help="stream a WAV file as one session and print every event")
    f.add_argument("file", metavar="FILE.wav")
    _add_connection(f)
    f.add_argument("--encoding", choices=[e.value for e in Encoding], default="linear16")
    f.add_argument("--sample-rate", type=int, default=16000, help="wire sample rate (default %(default)s)")
    f.add_argument(
        "--out-encoding", choices=[e.value for e in Encoding], help="reply encoding (default: as sent)"
    )
    f.add_argument("--out-sample-rate", type=int, help="reply sample rate (default: as sent)")
    f.add_argument("--realtime", action="store_true", help="pace the frames at real time")
    f.add_argument("--json", action="store_true", help="one JSON object per event")
    f.add_argument("--json-audio", action="store_true", help="keep reply audio (base64) in the JSON")
    f.add_argument("--out", metavar="REPLY.wav", help="write the reply audio to this WAV file")
    f.add_argument("--mode", choices=["auto", "ptt"], default="auto", help="segmentation (default auto)")
    f.add_argument(
        "--talk",
        type=_spans,
        metavar="S-E[,S-E]",
        help="push-to-talk spans in seconds of the file (with --mode ptt; default: the whole file)",
    )
    f.add_argument("--transcribe-only", action="store_true", help="use StreamingRecognize (no agent)")
    f.add_argument("--voice", default="", help="reply voice (default: the server's)")
    f.add_argument("--agent", default="", help="agent name: echo, openai, client, ...")
    _add_session(f)
    f.set_defaults(func=cmd_file)

    p = sub.add_parser("ptt", help="push-to-talk from the microphone; replies through the speakers")
    _add_connection(p)
    p.add_argument("--voice", default="")
    p.add_argument("--agent", default="")
    p.add_argument("--language", default="")
    p.add_argument("--input-device", help="sounddevice input device (name or index)")
    p.add_argument("--output-device", help="sounddevice output device (name or index)")
    p.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    p.set_defaults(func=cmd_ptt)

    ld = sub.add_parser("load", help="N concurrent real-time streams; event delay percentiles")
    _add_connection(ld)
    ld.add_argument("--sessions", type=int, required=True, metavar="N")
    ld.add_argument("--file", required=True, metavar="FILE.wav")
    ld.add_argument("--duration", type=float, default=30.0, metavar="S", help="seconds of audio per session")
    ld.add_argument("--transcribe-only", action="store_true", help="use StreamingRecognize")
    ld.add_argument("--encoding", choices=[e.value for e in Encoding], default="linear16")
    ld.add_argument("--sample-rate", type=int, default=16000)
    ld.add_argument("--gap", type=float, default=1.0, metavar="S", help="silence between repeats of the file")
    ld.add_argument(
        "--ramp", type=float, default=2.0, metavar="S", help="spread session starts over S seconds"
    )
    ld.add_argument(
        "--channels", type=int, default=0, help="HTTP/2 connections (default: one per 100 sessions)"
    )
    ld.add_argument(
        "--started-lag-ms",
        type=float,
        default=None,
        help="audio past SPEECH_STARTED's offset the server needs to decide (default: effective min_speech_ms)",
    )
    ld.add_argument(
        "--ended-lag-ms",
        type=float,
        default=0.0,
        help="audio past SPEECH_ENDED's offset the server needs to decide (default 0)",
    )
    ld.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _add_session(ld)
    ld.set_defaults(func=cmd_load)
    return parser


def _target(args: argparse.Namespace) -> Target:
    if args.ca and not args.tls:
        raise ClientError("--ca needs --tls")
    if args.ca and not Path(args.ca).is_file():
        raise ClientError(f"--ca {args.ca}: no such file")
    return Target(args.server, args.token, args.tls, args.ca)


def _format(encoding: str, rate: int) -> AudioFormat:
    try:
        return AudioFormat(Encoding(encoding), rate)
    except ValueError as e:
        raise ClientError(str(e)) from None


# ------------------------------------------------------------------------------------- commands


def cmd_file(args: argparse.Namespace) -> int:
    from .events import event_to_json, format_event
    from .session import SessionOptions, output_format_of, reply_audio, stream_file
    from .wavio import write_wav

    if not Path(args.file).is_file():
        raise ClientError(f"{args.file}: no such file")
    if args.talk and args.mode != "ptt":
        raise ClientError("--talk needs --mode ptt")
    out_fmt = None
    if args.out_encoding or args.out_sample_rate:
        out_fmt = _format(args.out_encoding or args.encoding, args.out_sample_rate or args.sample_rate)
    options = SessionOptions(
        input_format=_format(args.encoding, args.sample_rate),
        output_format=out_fmt,
        push_to_talk=args.mode == "ptt",
        language=args.language,
        interim_results=args.interim,
        recognition_disabled=args.vad_only,
        voice=args.voice,
        agent=args.agent,
        session_id=args.session_id,
        hangover_ms=args.hangover_ms,
    )

    def show(event, elapsed: float) -> None:
        if args.json:
            print(event_to_json(event, elapsed, include_audio=args.json_audio), flush=True)
        else:
            print(format_event(event, elapsed), flush=True)

    events = stream_file(
        _target(args),
        args.file,
        options,
        transcribe_only=args.transcribe_only or args.vad_only,
        realtime=args.realtime,
        talk_spans=args.talk,
        on_event=show,
    )
    if args.out:
        fmt = output_format_of(events, options.to_proto())
        pcm = reply_audio(events, fmt)
        write_wav(args.out, pcm, fmt.sample_rate)
        log.info("wrote %.2f s of reply audio (%s) to %s", len(pcm) / fmt.sample_rate, fmt, args.out)
    return 0


def cmd_ptt(args: argparse.Namespace) -> int:
    from . import ptt

    return ptt.run_cli(args, _target(args) if not args.list_devices else None)


def cmd_load(args: argparse.Namespace) -> int:
    from . import load

    if args.sessions < 1:
        raise ClientError("--sessions must be at least 1")
    if not Path(args.file).is_file():
        raise ClientError(f"{args.file}: no such file")
    return load.run_cli(args, _target(args), _format(args.encoding, args.sample_rate))


# ----------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    prog = f"voiced-client {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as e:
        print(f"{prog}: error: {describe_rpc_error(e, getattr(args, 'server', '?'))}", file=sys.stderr)
        return 1
    except (ClientError, WavError, OSError, ValueError) as e:
        log.debug("%s failed", prog, exc_info=True)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
