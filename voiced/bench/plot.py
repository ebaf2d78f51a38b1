"""`voiced bench plot`: how each end-to-end figure grows with the number of callers, drawn from
`voiced bench e2e --out` JSON (a caller sweep: `--sessions 1 2 4 8 16 24 32 48 64`), with the end-to-end
targets marked at the caller counts they name and the saturation point (voice-to-voice p99 as heard under
the run's `--saturation-ms`) on the voice-to-voice panel; and the same figures as a text table.

    voiced bench plot sweep.json --out docs/bench/           # sweep.png and sweep.svg
    voiced bench plot before.json after.json --out cmp.png   # two runs on the same axes

Several files share the axes (one line per run and quantile); files that are not e2e results are
skipped with a note. Levels a run lacks (older runs have no voice-to-voice as heard, no per-level GPU
memory) are left out of their panel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voiced.bench.saturation import level_errors, saturation
from voiced.bench.targets import E2E_LEVEL_TARGETS, TARGETS

FIGSIZE, DPI = (16, 9), 100  # 1600 x 900 pixels
V2V_HEARD, V2V_SENT = "v2v_client_ms", "first_audio_ms"
# (figure in a level, panel title, y label, quantiles drawn)
LATENCIES = [(V2V_HEARD, "voice-to-voice as heard: end of speech -> first reply audio", "ms", ("p50", "p90", "p99")),
             ("asr_ms", "end of speech -> final transcript", "ms", ("p50", "p99")),
             ("tts_first_chunk_ms", "TTS first chunk: reply text -> first audio chunk", "ms", ("p50", "p99")),
             ("rtf", "TTS real-time factor (generation time / audio time)", "RTF", ("p50", "p99"))]
STYLE = {"p50": "-o", "p90": "--s", "p99": ":^"}


def load(paths: list[Path]) -> list[tuple[str, dict]]:
    runs = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        if r.get("bench") != "e2e" or not r.get("levels"):
            print(f"skipped {p}: not a `voiced bench e2e` result")
            continue
        runs.append((Path(p).stem, r))
    return runs


def levels_of(run: dict) -> list[tuple[int, dict]]:
    return sorted((int(n), level) for n, level in run["levels"].items())


def saturation_of(run: dict, figure: str) -> dict:
    """The run's own verdict (its first front's, at its limit), or, for runs made before the bench
    reported it or drawn on another figure, one computed from its levels (at 500 ms if it names none)."""
    front = next(iter(run.get("fronts", {})), None)
    own = run.get("saturation", {}).get(front)
    if own and own["metric"] == figure:
        return own
    return saturation(run["levels"], own["limit_ms"] if own else 500.0, figure)


def v2v_figure(runs: list[tuple[str, dict]]) -> str:
    """Voice-to-voice as heard where every run has it; else as the daemon sent it (older runs)."""
    heard = all(any(V2V_HEARD in lv for _, lv in levels_of(r)) for _, r in runs)
    return V2V_HEARD if heard else V2V_SENT


def fmt(level: dict, figure: str, qs: tuple[str, ...]) -> str:
    d = level.get(figure, {})
    return " / ".join("-" if d.get(q) is None else f"{d[q]:g}" for q in qs)


def table(name: str, run: dict, v2v: str) -> str:
    sat = saturation_of(run, v2v)
    head = (f"{name}: {run.get('gpu', '?')}, {run.get('date', '?')}, "
            f"{run.get('duration_s', '?')} s a level, start-up {run.get('startup_s', '?')} s")
    rows = [("callers", f"v2v {'heard' if v2v == V2V_HEARD else 'sent'} p50/p90/p99", "transcript p50/p99",
             "first chunk p50/p99", "RTF p50/p99", "GPU peak GiB", "errors")]
    for n, lv in levels_of(run):
        mem = lv.get("gpu_memory", {}).get("peak_gib")
        rows.append((str(n), fmt(lv, v2v, ("p50", "p90", "p99")), fmt(lv, "asr_ms", ("p50", "p99")),
                     fmt(lv, "tts_first_chunk_ms", ("p50", "p99")), fmt(lv, "rtf", ("p50", "p99")),
                     "-" if mem is None else f"{mem:g}", str(level_errors(lv))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(saturation_line(sat))
    return "\n".join(lines)


def saturation_line(sat: dict) -> str:
    limit = f"{sat['quantile']} < {sat['limit_ms']:g} ms"
    if not sat["saturated"]:
        return f"saturation: voice-to-voice {limit} at every level measured (up to {sat['capacity']} callers)"
    if sat["capacity"] == 0:
        return f"saturation: voice-to-voice {limit} at no level measured (over at {sat['first_over']})"
    note = f"; passed again at {sat['passed_above']}" if sat["passed_above"] else ""
    return (f"saturation: voice-to-voice {limit} up to {sat['capacity']} callers "
            f"(over at {sat['first_over']}{note})")


def mark_targets(ax, figure: str, callers: list[int]) -> None:
    """Issue 15's targets on this figure: a short bar at the target, at the caller count it names
    (where that count is within the range the runs measured)."""
    first = True
    for key, (fig, q, n) in E2E_LEVEL_TARGETS.items():
        t = TARGETS[key]
        if fig != figure or t.issue != 15 or not callers[0] <= n <= callers[-1]:
            continue
        ax.hlines(t.limit, n / 1.35, n * 1.35, colors="crimson", linewidths=2.5,
                  label="end-to-end target" if first else None)
        ax.annotate(f"{q} ≤ {t.limit:g}", (n * 1.35, t.limit), fontsize=8, color="crimson",
                    xytext=(3, -3), textcoords="offset points")
        first = False


def mark_saturation(ax, sat: dict, color) -> None:
    if not any(line.get_label().startswith("saturation limit") for line in ax.lines):
        ax.axhline(sat["limit_ms"], color="grey", linestyle="-.", linewidth=1,
                   label=f"saturation limit ({sat['quantile']} {sat['limit_ms']:g} ms)")
    n = sat["capacity"]
    if n:
        ax.axvline(n, color=color, linestyle="-.", linewidth=1.2)
        text = f"{'≥ ' if not sat['saturated'] else ''}{n} callers"
        ax.annotate(f"saturates: {text}", (n, sat["limit_ms"]), rotation=90, fontsize=8, color=color,
                    xytext=(-11, -4), textcoords="offset points", ha="left", va="top")


def draw(runs: list[tuple[str, dict]], out: Path) -> list[Path]:
    import matplotlib  # missing: the command line names the extra (voiced.extras)

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, and smaller
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    v2v = v2v_figure(runs)
    panels = [(v2v if f == V2V_HEARD else f, t if f != V2V_HEARD or v2v == V2V_HEARD else
               "voice-to-voice as sent: end of speech -> first reply audio sent", u, qs) for f, t, u, qs in LATENCIES]
    fig, axes = plt.subplots(2, 3, figsize=FIGSIZE, dpi=DPI)
    axes = axes.ravel()
    several = len(runs) > 1
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_n = sorted({n for _, r in runs for n, _ in levels_of(r)})
    for i, (name, run) in enumerate(runs):
        levels = levels_of(run)
        xs = [n for n, _ in levels]
        for ax, (figure, _, _, qs) in zip(axes, panels):
            for j, q in enumerate(qs):
                pts = [(n, lv[figure][q]) for n, lv in levels if lv.get(figure, {}).get(q) is not None]
                if pts:
                    color = cycle[i % len(cycle)] if several else cycle[j]  # several runs: a colour each
                    ax.plot(*zip(*pts), STYLE[q], color=color, label=f"{name} {q}" if several else q)
        mem = [(n, lv["gpu_memory"]) for n, lv in levels if "gpu_memory" in lv]
        color = cycle[i % len(cycle)]
        if mem:
            axes[4].plot([n for n, _ in mem], [m["peak_gib"] for _, m in mem], "-o", color=color,
                         label=f"{name + ' ' if several else ''}peak allocated")
            axes[4].plot([n for n, _ in mem], [m.get("reserved_gib") for _, m in mem], "--s", color=color,
                         label=f"{name + ' ' if several else ''}reserved")
        warm = run.get("gpu_memory", {}).get("TTS load and warm-up", {}).get("allocated_gib")
        if warm is not None:
            axes[4].axhline(warm, color=color, linestyle=":", linewidth=1,
                            label=f"{name + ' ' if several else ''}held after warm-up")
        axes[5].plot(xs, [level_errors(lv) for _, lv in levels], "-o", color=color, label=name if several else None)
        mark_saturation(axes[0], saturation_of(run, v2v), color)
    for ax, (figure, _, _, _) in zip(axes, panels):
        mark_targets(ax, figure, all_n)
    axes[3].axhline(1.0, color="grey", linestyle="-.", linewidth=1, label="real time")
    if not axes[4].lines:
        axes[4].text(0.5, 0.5, "no GPU memory figures in these runs", ha="center", va="center",
                     transform=axes[4].transAxes)
    titles = [t for _, t, _, _ in panels] + ["GPU memory per level (torch allocator)",
                                              "errors per level (failed callers, notices, unanswered)"]
    ylabels = [u for _, _, u, _ in panels] + ["GiB", "count"]
    for ax, title, ylabel in zip(axes, titles, ylabels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrent real-time callers")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_n)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[5].set_ylim(0, max(1.0, axes[5].get_ylim()[1]))
    axes[5].yaxis.get_major_locator().set_params(integer=True)
    first = runs[0][1]
    fig.suptitle(f"voiced end to end, callers over gRPC, on {first.get('gpu', '?')} ({first.get('date', '?')})")
    fig.tight_layout()
    if out.suffix in (".png", ".svg"):
        files = [out]
    else:
        out.mkdir(parents=True, exist_ok=True)
        stem = runs[0][0] if not several else f"{runs[0][0]}-and-{len(runs) - 1}-more"
        files = [out / f"{stem}.png", out / f"{stem}.svg"]
    for f in files:
        fig.savefig(f, dpi=DPI)
    plt.close(fig)
    return files


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(prog="voiced bench plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="`voiced bench e2e --out` JSON files")
    ap.add_argument("--out", type=Path, default=Path("."),
                    help="a folder (gets NAME.png and NAME.svg, NAME: the first file's) or one .png/.svg file")
    a = ap.parse_args(argv)
    missing = [str(p) for p in a.results if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    runs = load(a.results)
    if not runs:
        ap.error("no e2e results among the files (plot draws `voiced bench e2e --out` JSON)")
    v2v = v2v_figure(runs)
    for name, run in runs:
        print(table(name, run, v2v))
    files = draw(runs, a.out)
    for f in files:
        print(f"wrote {f}")
    return files


if __name__ == "__main__":
    main()
