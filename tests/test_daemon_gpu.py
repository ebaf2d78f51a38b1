"""The daemon on the GPU, black box (skipped without CUDA): `python -m voiced serve` as a subprocess with
both engines on random checkpoints in the real formats, one Converse call from our client
(voiced_client) and one from a client whose stubs are generated here from proto/ by grpc_tools; then
health, the start-up memory plan against the GPU memory PyTorch's allocator used, and SIGTERM.

One module-scoped daemon; the tests run in file order (they read the same process).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gpu_phrases import DAEMON
from tests.spark_fixtures import make_spark_checkpoint
from tests.speech import layout, write_wav
from tests.whisper_fixtures import make_openai_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300  # model load and warm-up (torch.compile on a cold cache); the test waits on health
CALL_TIMEOUT_S = 120
PLAN_TOLERANCE = 0.05  # issue 20: the printed plan within 5 % of what was used
SERVING = health_pb2.HealthCheckResponse.SERVING


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_toml(whisper: Path, spark: Path, voices: Path, port: int, mport: int) -> str:
    return textwrap.dedent(f"""\
        [server]
        listen = "127.0.0.1:{port}"
        metrics_listen = "127.0.0.1:{mport}"

        [asr]
        model = "{whisper}"
        device = "cuda"
        language = "en"
        max_batch = 4
        max_new_tokens = 10  # a random model never ends on its own
        # Random weights look like hallucinations to the filters; the test wants every transcript.
        no_speech_threshold = 1.0
        logprob_threshold = -1e9
        compression_ratio_threshold = 1e9

        [tts]
        model = "{spark}"
        device = "cuda"
        max_batch = 4
        max_seconds = 1.0  # nor does a random LM: each reply is capped at 1 s of audio
        voices_dir = "{voices}"

        [agent]
        default = "echo"
        """)


class Daemon:
    def __init__(self, proc: subprocess.Popen, log: Path, address: str, metrics: str):
        self.proc, self.log, self.address, self.metrics = proc, log, address, metrics

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def health(self) -> int:
        with grpc.insecure_channel(self.address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status

    def gpu_memory(self) -> dict[str, float]:
        """voiced_gpu_memory_bytes{kind} of the daemon's GPU, from its Prometheus endpoint."""
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        out = {}
        for m in re.finditer(r'^voiced_gpu_memory_bytes\{device="cuda:0",kind="(\w+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out


def wait_serving(d: Daemon) -> None:
    """Wait on health's Watch stream (it sends each change) until SERVING, or the process ends."""
    with grpc.insecure_channel(d.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S)
        try:
            for update in watch:
                if update.status == SERVING:
                    return
        except grpc.RpcError as e:
            pytest.fail(f"the daemon did not become SERVING ({e.code().name}: {e.details()}); "
                        f"exit status {d.proc.poll()}; log:\n{d.tail()}")
    pytest.fail(f"health's Watch ended before SERVING; log:\n{d.tail()}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("daemon")
    whisper = make_openai_checkpoint(root / "whisper", seed=3)
    spark = make_spark_checkpoint(root / "Spark-TTS-0.5B", seed=0)
    port, mport = free_port(), free_port()
    cfg = root / "voiced.toml"
    cfg.write_text(config_toml(whisper, spark, root / "voices", port, mport))
    # VOICED_TTS_COMPILE=0 ([tts] compile): the TTS decode runs uncompiled (CUDA graphs still on). Its warm-up
    # would otherwise compile 15 decode graphs and 64 prompt lengths in a fresh process, 90 s of the suite's
    # 5 minutes; the compiled step is checked engine-level in tests/test_spark_gpu.py.
    env = dict(os.environ, PYTHONUNBUFFERED="1", VOICED_TTS_COMPILE="0",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")]))
    log = root / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--config", str(cfg)], cwd=root, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    d = Daemon(proc, log, f"127.0.0.1:{port}", f"127.0.0.1:{mport}")
    try:
        wait_serving(d)
        yield d
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        print(f"--- voiced serve log ({log}) ---\n{d.tail(80)}")


@pytest.fixture(scope="module")
def caller_wav(tmp_path_factory):
    return write_wav(tmp_path_factory.mktemp("caller") / "question.wav", layout(list(DAEMON), lead_s=0.5, tail_s=1.0).audio)


def check_conversation(who: str, kinds: list[str], finals: list[str], reply_types: list[str], audio_bytes: int,
                       status: str) -> None:
    summary = f"{who}: status {status}, events {kinds}, final transcripts {finals}, replies {reply_types}, " \
              f"{audio_bytes} bytes of reply audio"
    assert status == "OK", summary
    assert kinds[0] == "started", summary
    assert len(finals) == 1 and finals[0].strip(), summary
    assert reply_types == ["REPLY_STARTED", "REPLY_FINISHED"], summary
    # max_seconds 1.0 at 16 kHz LINEAR16: a reply is at most 32000 bytes
    assert 0 < audio_bytes <= 32000, summary


def test_converse_with_our_client(daemon, caller_wav):
    """voiced_client streams the WAV (16 kHz LINEAR16, 20 ms frames), half-closes and reads to the end:
    one final transcript, the echo agent's reply spoken back (REPLY_STARTED, audio, REPLY_FINISHED), OK."""
    from voiced_client.audio import AudioFormat, Encoding
    from voiced_client.connect import Target
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.session import SessionOptions, load_clip, stream_clip

    fmt = AudioFormat(Encoding.LINEAR16, 16000)
    try:
        events = stream_clip(Target(daemon.address), load_clip(caller_wav, fmt), SessionOptions(fmt, language="en"),
                             timeout=CALL_TIMEOUT_S)
        status = "OK"
    except grpc.RpcError as e:
        events, status = [], f"{e.code().name}: {e.details()}"
    check_conversation(
        "voiced_client", [e.WhichOneof("event") for e in events],
        [e.transcript.text for e in events if e.HasField("transcript") and e.transcript.is_final],
        [pb.ReplyEvent.Type.Name(e.reply.type) for e in events if e.HasField("reply")],
        sum(len(e.audio.audio) for e in events if e.HasField("audio")), status)


CLIENT = '''
import json, sys, wave
import grpc
import voiced_pb2 as pb, voiced_pb2_grpc as pb_grpc

address, wav = sys.argv[1], sys.argv[2]
with wave.open(wav) as w:
    assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
    pcm = w.readframes(w.getnframes())
def requests():
    yield pb.SessionRequest(config=pb.SessionConfig(
        input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000),
        recognition=pb.RecognitionConfig(language="en")))
    for i in range(0, len(pcm), 640):
        yield pb.SessionRequest(audio=pcm[i : i + 640])
out = {"kinds": [], "finals": [], "replies": [], "audio_bytes": 0, "status": "OK"}
with grpc.insecure_channel(address) as channel:
    try:
        for ev in pb_grpc.VoicedStub(channel).Converse(requests(), timeout=float(sys.argv[3])):
            kind = ev.WhichOneof("event")
            out["kinds"].append(kind)
            if kind == "transcript" and ev.transcript.is_final:
                out["finals"].append(ev.transcript.text)
            elif kind == "reply":
                out["replies"].append(pb.ReplyEvent.Type.Name(ev.reply.type))
            elif kind == "audio":
                out["audio_bytes"] += len(ev.audio.audio)
    except grpc.RpcError as e:
        out["status"] = f"{e.code().name}: {e.details()}"
print(json.dumps(out))
'''


def test_converse_with_a_client_generated_from_the_proto(daemon, caller_wav, tmp_path):
    """A client we did not write: stubs generated from proto/voiced/v1/voiced.proto by grpc_tools into
    an empty directory, run in its own process that imports nothing of ours. Same expectations."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    proto = REPO / "proto" / "voiced" / "v1"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto}", f"--python_out={stubs}",
                    f"--grpc_python_out={stubs}", str(proto / "voiced.proto")], check=True, capture_output=True)
    (stubs / "client.py").write_text(CLIENT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # only the packages the environment adds (a wheel folder on the GPU machine), never our sources
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() not in (REPO, REPO / "client")]
    env["PYTHONPATH"] = os.pathsep.join(extra)
    run = subprocess.run([sys.executable, "client.py", daemon.address, str(caller_wav), str(CALL_TIMEOUT_S)],
                         cwd=stubs, env=env, capture_output=True, text=True, timeout=CALL_TIMEOUT_S + 30)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    check_conversation("generated stubs", out["kinds"], out["finals"], out["replies"], out["audio_bytes"], out["status"])


def test_health_is_serving_after_the_calls(daemon):
    assert daemon.health() == SERVING


PLAN_TOTAL = re.compile(r"^total \(held \+ (?P<what>the largest one transient|each engine's largest transient)\)"
                        r"\s+(?P<bytes>[\d,]+)\s", re.M)
PLAN_TRANSIENT = re.compile(r"^(?P<engine>\S+)\s+.*transient.*?\s(?P<bytes>[\d,]+)\s+[\d.]+$", re.M)


def printed_plan(log: str) -> tuple[int, int, str]:
    """The total (bytes) of the torch engines' memory plan `voiced serve` logs at start-up, what of it
    allows for both engines' step transients at once (engines on a thread each; 0 on one thread), and
    the table."""
    at = log.rfind("GPU memory plan (torch backend")  # the last: both engines (each also logs its own)
    assert at >= 0, "the daemon printed no GPU memory plan for its torch engines at start-up"
    block = log[at:].split("\n\n")[0]
    m = PLAN_TOTAL.search(block)
    assert m, f"no total row in the printed plan:\n{block}"
    both = 0
    if m.group("what").startswith("each"):
        largest: dict[str, int] = {}
        for t in PLAN_TRANSIENT.finditer(block):
            largest[t.group("engine")] = max(largest.get(t.group("engine"), 0), int(t.group("bytes").replace(",", "")))
        both = min(largest.values(), default=0)
    return int(m.group("bytes").replace(",", "")), both, block


def test_the_start_up_memory_plan_is_what_the_gpu_used(daemon):
    """Compares the total of the memory plan printed at start-up for the torch engines (computed from the
    checkpoints and max_batch before loading: weights, caches, what the CUDA graphs keep, cuBLAS
    workspaces, the largest step transient) with the GPU's peak: the larger of what PyTorch's allocator
    reports after the calls and the TTS warm-up's phase peaks (the torch backend: TensorRT-LLM does not
    run here). Issue 20 asks for them within 5 %. With an engine thread each (on a GPU by default) the
    plan also allows for both engines' step transients at once, which these one-at-a-time calls need not
    reach: the peak is then held to the plan less the smaller engine's transient, up to the plan."""
    planned, both, table = printed_plan(daemon.log_text())
    mem = daemon.gpu_memory()
    assert "peak_allocated" in mem, "the daemon's metrics report no GPU memory (voiced_gpu_memory_bytes)"
    # The TTS warm-up measures each of its phases' peak (it resets the allocator's peak between them), so
    # the metric's peak starts after it: the GPU's peak is the larger of the two.
    warm = re.search(r"TTS warm-up: .*GPU memory peaks ([\d. /]+) MiB", daemon.log_text())
    assert warm, "the daemon logged no TTS warm-up peaks"
    warm_peak = max(float(v) for v in warm.group(1).split("/")) * 2**20
    peak = max(mem["peak_allocated"], warm_peak)
    off = max(0.0, peak - planned, planned - both - peak) / planned
    assert off <= PLAN_TOLERANCE, (
        f"the start-up plan totals {planned / 2**20:.1f} MiB but the GPU peaked at {peak / 2**20:.1f} MiB (PyTorch's "
        f"allocator after the calls {mem['peak_allocated'] / 2**20:.1f}, allocated now {mem['allocated'] / 2**20:.1f}, "
        f"reserved {mem['reserved'] / 2**20:.1f} MiB; the TTS warm-up's phases peaked at {warm.group(1)} MiB): off by "
        f"{off:.1%}, more than {PLAN_TOLERANCE:.0%}\n{table}")


def test_sigterm_ends_the_daemon_cleanly(daemon):
    daemon.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    code = daemon.proc.wait(60)
    assert code == 0, f"exit status {code} {time.monotonic() - t0:.1f} s after SIGTERM; log:\n{daemon.tail()}"
    assert "Traceback" not in daemon.log_text(), daemon.tail(80)
