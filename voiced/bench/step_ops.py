"""How many Python -> PyTorch calls and host syncs each kind of engine step makes (issue 26).

    python -m voiced.bench.step_ops [--batches 1 16 64] [--engines whisper spark] [--out FILE]

On a GPU with two engine threads and the event loop, every PyTorch call made from Python releases and
retakes the GIL, so a step's host cost is its number of calls times the wait for the GIL (up to the
switch interval while another thread runs Python), plus every blocking sync. This counts both, per
kind of step, on the CPU: the engines are built from small random checkpoints in the real formats
(the tests' fixtures) and run batches of requests to the end, once under a counting
`TorchFunctionMode` and once plain for the CPU time.

- calls: PyTorch functions and tensor methods called from Python (property reads such as `.shape`
  excluded). Calls made inside a counted call are not counted again.
- readbacks: `.tolist()`, `.item()`, `.cpu()`, `int()/float()/bool()` of a tensor: on a GPU, each waits
  for the stream.
- list->device: `torch.tensor(data, device=...)` and `.to(device)` of a host tensor that is not
  pinned, `non_blocking` or not: on a GPU a copy from pageable memory, which first waits for the
  stream too.
- cpu ms: this thread's CPU time per call of the kind (tiny models: mostly the host's own overhead).

Rows named "network: ..." are the forward passes that run as CUDA graphs on a GPU (one replay call
there), except the vocoder, which runs eagerly unless `VOICED_SPARK_VOCODER_GRAPHS=1`. The Whisper
engine runs with the GPU's settings (decode chunk 8, encoder batch 16) so its host loop has the
GPU's shape, except where the GPU takes another path: "admit: encode + cross K/V write" counts the
CPU's per-layer cross keys/values (6 torch calls a layer: 2 views, 2 projections, 2 copies); on a GPU
(by default; VOICED_WHISPER_CROSS_IN_ENCODER=0 turns it off) they are made in the encoder's graph and
copied with ~6 calls plus 3 per beam index, whatever the layer count. `rows.to_device` is one `torch.tensor` here; on a GPU
5 through the staging ring (the default), with no pinned allocation; 3 with a fresh pinned block per call
(VOICED_PINNED_STAGING_RING=0).

The greedy chunk (`_greedy_chunk`, decode chunk 8) runs here as on a GPU without chunk graphs: per step one
"network: decoder step + greedy" call (a greedy graph replay there) and two history writes counted in
"greedy chunk (host side)", so 3 x 8 = 24 calls per full chunk beside the chunk's fixed ones (views, the
inputs' copy, the one `.tolist()`). On a GPU with chunk graphs (the default; VOICED_WHISPER_CHUNK_GRAPHS=0 turns them off) a full
chunk of a bucket captured at warm-up is one call instead (one replay of the chunk graph: the 8 steps and
their 16 history writes) and the 4 views the loop makes go too; a chunk cut short near a row's length limit
still costs 3 per step. That path never runs on the CPU, so these rows do not show it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from voiced.bench.report import cpu_model

READBACKS = {"tolist", "item", "cpu", "__int__", "__float__", "__bool__", "__index__"}


class StepCounter(TorchFunctionMode):
    """Counts calls per label (the innermost one open) and times each label's own CPU time."""

    def __init__(self, count: bool) -> None:
        super().__init__()
        self.count = count
        self.stack: list[str] = ["other"]
        self.stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._t = time.thread_time()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name != "__get__":
            s = self.stats[self.stack[-1]]
            s["calls"] += 1
            if name in READBACKS:
                s["readbacks"] += 1
            elif name == "tensor" and kwargs.get("device") is not None and not kwargs.get("pin_memory"):
                s["list_to_device"] += 1
            elif name == "to" and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])) \
                    and args[0].device.type == "cpu" and not args[0].is_pinned():
                s["list_to_device"] += 1
        return func(*args, **kwargs)

    def _switch(self) -> None:
        now = time.thread_time()
        self.stats[self.stack[-1]]["cpu_ms"] += (now - self._t) * 1e3
        self._t = now

    @contextlib.contextmanager
    def label(self, name: str):
        self._switch()
        self.stack.append(name)
        self.stats[name]["n"] += 1
        try:
            yield
        finally:
            self._switch()
            self.stack.pop()

    def wrap(self, owner, attr: str, name: str) -> None:
        """Count `owner.attr` (a method, or a module's forward) under `name`."""
        fn = getattr(owner, attr)

        def run(*a, **kw):
            with self.label(name):
                return fn(*a, **kw)
        setattr(owner, attr, run)

    @contextlib.contextmanager
    def active(self):
        if not self.count:
            yield
            return
        with self:
            yield


# Whisper: (owner path, attribute, label). Innermost label wins.
WHISPER_KINDS = [
    ("", "_audio", "admit: audio to the device"),
    ("", "_encode_into_cache", "admit: encode + cross K/V write"),
    ("model.encoder", "forward", "network: encoder (graph on GPU)"),
    ("", "_detect_languages", "admit: language detection"),
    ("", "_prefill", "admit: prefill"),
    ("", "_select", "token choice (admission, beams)"),
    ("", "_greedy_chunk", "greedy chunk (host side)"),
    ("", "_decode", "plain step (host side)"),
    ("steps", "greedy", "network: decoder step + greedy (graph on GPU)"),
    ("_decoder", "step", "network: decoder step (graph on GPU)"),
    ("", "_finish", "finish"),
    ("", "_words", "finish: word timing"),
    ("", "_release", "release: row compaction"),
]

SPARK_KINDS = [
    ("", "_prefill_step", "prefill: first tokens"),
    ("", "_prefill_fresh", "prefill: prompts, packing"),
    ("lm", "_prefill_body", "network: packed prefill (graph on GPU)"),
    ("", "_decode_step", "decode chunk (host side)"),
    ("", "_load_state", "decode: load state"),
    ("lm", "_steps_body", "network: decode steps + sampling (graph on GPU)"),
    ("", "_vocode", "vocoder turn (host side)"),
    ("codec", "decode", "network: vocoder (eager on GPU)"),
    ("", "_release", "release: row compaction"),
]


def _instrument(engine, counter: StepCounter, kinds) -> None:
    for path, attr, name in kinds:
        owner = engine
        for p in filter(None, path.split(".")):
            owner = getattr(owner, p)
        counter.wrap(owner, attr, name)


def whisper_engine(workdir: Path, batch: int):
    from tests.whisper_fixtures import make_openai_checkpoint
    from voiced.engines.whisper.engine import WhisperEngine

    ckpt = workdir / "whisper.pt"
    if not ckpt.exists():
        ckpt = make_openai_checkpoint(workdir, name="whisper.pt")
    return WhisperEngine.load(ckpt, max_batch=max(batch, 1), max_encoder_batch=16, decode_chunk=8)


def whisper_requests(batch: int, tokens: int):
    """A serving mix: forced lengths; a quarter detect their language, a quarter want word times."""
    from voiced.engines.base import ASROptions, ASRRequest

    rng = np.random.default_rng(0)
    out = []
    for i in range(batch):
        audio = (0.1 * rng.standard_normal(16000 * (2 + i % 4))).astype(np.float32)
        opts = ASROptions(language=None if i % 4 == 1 else "en", word_timestamps=i % 4 == 3,
                          max_new_tokens=tokens, min_new_tokens=tokens)
        out.append(ASRRequest(audio, opts))
    return out


def spark_engine(workdir: Path, batch: int):
    from tests.spark_fixtures import make_spark_checkpoint
    from voiced.engines.spark.engine import SparkTTSEngine

    root = workdir / "Spark-TTS-0.5B"
    if not root.exists():
        make_spark_checkpoint(root)
    engine = SparkTTSEngine.load(root, device="cpu", max_batch=max(batch, 1), max_seq_len=1024)
    engine.force_reply_lengths()
    engine.use_random_voice()
    return engine


def spark_requests(batch: int, seconds: float):
    from voiced.engines.base import TTSOptions, TTSRequest

    return [TTSRequest("Hello there, this is a reply.", TTSOptions(seed=i, max_seconds=seconds)) for i in range(batch)]


def run(engine, requests, counter: StepCounter) -> int:
    """Submit every request, step until all are done; returns the number of steps."""
    for i, r in enumerate(requests):
        engine.submit(i, r)
    steps = 0
    with counter.active():
        while engine.has_work():
            with counter.label("step (the rest)"):
                engine.step()
            steps += 1
    return steps


def measure(name: str, batch: int, workdir: Path, size: float) -> dict:
    build, requests, kinds = {"whisper": (whisper_engine, whisper_requests, WHISPER_KINDS),
                              "spark": (spark_engine, spark_requests, SPARK_KINDS)}[name]
    passes = {}
    for count in (True, False):
        torch.manual_seed(0)
        engine = build(workdir, batch)
        counter = StepCounter(count)
        _instrument(engine, counter, kinds)
        steps = run(engine, requests(batch, size), counter)
        passes[count] = (counter.stats, steps)
    (counts, steps), (times, _) = passes[True], passes[False]
    rows = {}
    for label, s in counts.items():
        n = max(1, int(s["n"]))
        rows[label] = {"n": n, "calls": round(s["calls"] / n, 1), "readbacks": round(s["readbacks"] / n, 2),
                       "list_to_device": round(s["list_to_device"] / n, 2),
                       "cpu_ms": round(times.get(label, {}).get("cpu_ms", 0.0) / n, 3)}
    fields = ("calls", "readbacks", "list_to_device")
    total = {k: sum(s[k] for s in counts.values()) for k in fields}
    host = {k: sum(s[k] for label, s in counts.items() if not label.startswith("network")) for k in fields}
    return {"engine": name, "batch": batch, "steps": steps, "per_step": {k: round(v / steps, 1) for k, v in total.items()},
            "host_per_step": {k: round(v / steps, 1) for k, v in host.items()}, "kinds": rows}


def table(results: list[dict]) -> str:
    lines = ["| engine | requests | kind | calls of the kind | torch calls / call | readbacks / call | "
             "list->device / call | CPU ms / call |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for label, r in sorted(res["kinds"].items()):
            if label == "other":
                continue
            lines.append(f"| {res['engine']} | {res['batch']} | {label} | {r['n']} | {r['calls']} | {r['readbacks']} | "
                         f"{r['list_to_device']} | {r['cpu_ms']} |")
        for key, what in (("host_per_step", "host side (no network rows), per step"), ("per_step", "all, per step")):
            p = res[key]
            lines.append(f"| {res['engine']} | {res['batch']} | **{what}** ({res['steps']} steps) | | "
                         f"{p['calls']} | {p['readbacks']} | {p['list_to_device']} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--engines", nargs="+", default=["whisper", "spark"], choices=["whisper", "spark"])
    ap.add_argument("--whisper-tokens", type=int, default=24, help="forced tokens per utterance")
    ap.add_argument("--spark-seconds", type=float, default=1.0, help="forced audio per reply")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random checkpoints go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # shared CPUs: host overhead, not parallel kernels, is what is measured
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        results = [measure(name, b, workdir, args.whisper_tokens if name == "whisper" else args.spark_seconds)
                   for name in args.engines for b in args.batches]
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"machine": cpu_model(), "torch": torch.__version__, "results": results},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
