"""Two benchmark daemons behind the shipped HAProxy configuration, started and stopped by deploy/haproxy/daemons.sh,
called by `voiced bench e2e --target`: what a two-GPU machine runs, on the CPU with tiny random models.

The callers go through the balancer as a telephony front end's would: every caller is answered, the calls
spread over both daemons, and a daemon drained mid-run (SIGTERM) lets its calls finish while the next
level's calls all go to the other one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.test_load_balancer import common_port, free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "haproxy" / "daemons.sh"

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make test installs it with apt)")


def active(address: str) -> int | None:
    """The daemon's open sessions; None once it is gone."""
    try:
        with grpc.insecure_channel(address) as channel:
            return pb_grpc.VoicedStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_sessions
    except grpc.RpcError:
        return None


@pytest.mark.slow
def test_the_bench_through_haproxy_is_answered_by_both_daemons_and_a_drain_loses_nothing(tmp_path):
    from tests.speech import layout, write_wav

    hosts = ("127.0.0.1", "127.0.0.2")
    lb = f"127.0.0.1:{free_port()}"
    grpc_port, http_port = common_port(*hosts), common_port(*hosts)
    env = dict(os.environ, VOICED_RUN_DIR=str(tmp_path / "run"), VOICED_GRPC_PORT=str(grpc_port),
               VOICED_HTTP_PORT=str(http_port), VOICED_LB_GRPC=lb, VOICED_START_TIMEOUT="300",
               VOICED_LB_AUDIOSOCKET=f"127.0.0.1:{free_port()}", VOICED_LB_WYOMING=f"127.0.0.1:{free_port()}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]))
    daemon = [sys.executable, "-m", "voiced", "bench", "e2e", "--serve", "--tiny-cpu", "--asr-dims", "tiny-random",
              "--asr-batch", "8", "--tts-batch", "8", "--asr-tokens", "4", "--reply-seconds", "0.3"]
    wav = tmp_path / "speech.wav"
    write_wav(wav, layout(["What time does the shop open tomorrow?"], lead_s=0.3, tail_s=1.0).audio)
    addresses = [f"{h}:{grpc_port}" for h in hosts]
    try:
        subprocess.run(["bash", str(SCRIPT), "start", "2", *daemon], env=env, check=True, timeout=400)
        out = tmp_path / "e2e.json"
        bench = subprocess.Popen([sys.executable, "-m", "voiced", "bench", "e2e", "--target", lb, "--tiny-cpu",
                                  "--wav", str(wav), "--sessions", "4", "6", "--duration", "6", "--reply-seconds",
                                  "0.3", "--out", str(out)], env=env, stderr=(tmp_path / "bench.log").open("w"),
                                 stdout=subprocess.DEVNULL)
        # Level 1: both daemons hold calls at once (least connections), then the first one drains.
        seen = [0, 0]
        deadline = time.monotonic() + 300
        while min(seen) == 0:
            assert bench.poll() is None and time.monotonic() < deadline, (seen, (tmp_path / "bench.log").read_text())
            seen = [max(s, active(a) or 0) for s, a in zip(seen, addresses)]
            time.sleep(0.1)
        drain = threading.Thread(target=subprocess.run, args=(["bash", str(SCRIPT), "drain", "1"],),
                                 kwargs={"env": env, "check": True, "timeout": 300})
        drain.start()
        # Level 2 begins once level 1's callers are done: every one of its calls is the second daemon's, while
        # the first holds none (draining, then gone).
        on_second = 0
        while bench.poll() is None:
            if not active(addresses[0]):
                on_second = max(on_second, active(addresses[1]) or 0)
            time.sleep(0.1)
        drain.join(300)
        assert bench.returncode == 0, (tmp_path / "bench.log").read_text()[-3000:]
        result = json.loads(out.read_text())
        assert result["target"] == lb and result["asr"]["device"] == "cpu", result
        for n, level in result["levels"].items():
            assert level["callers"] == int(n) and (level["failed_callers"], level["notices"]) == ({}, {}), level
            assert level["unanswered"] == 0 and level["v2v_client_ms"]["n"] >= int(n), level
        assert on_second == 6, f"the second daemon held {on_second} of level 2's 6 calls at most"
        assert not os.path.exists(tmp_path / "run" / "daemon1.pid"), "the drained daemon did not exit"
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, timeout=300)
    assert not list((tmp_path / "run").glob("*.pid")), "daemons.sh stop left processes behind"
