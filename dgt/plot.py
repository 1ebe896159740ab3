"""``python -m dgt.plot LOG... -o DIR``: PNG plots of training curves and dgt statistics.

Reads the JSON-lines curves the examples write (``--log``; records with ``event`` = ``step``,
``eval``, ``summary``) and the per-step statistics workers write (``DGT_STATS``; records with
``bytes_per_channel`` and ``k``).  Writes, for whatever the inputs contain:

* ``accuracy_vs_time.png`` and ``accuracy_vs_step.png`` (one line per run),
* ``loss_vs_step.png``,
* ``bytes_per_channel.png`` (cumulative payload bytes per channel, per run),
* ``k_vs_time.png`` (the reliable fraction k as training goes).

Needs matplotlib (``pip install 'dgt[examples]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

__all__ = ["load_runs", "plot_runs", "main"]


def load_runs(paths: List[str]) -> Dict[str, dict]:
    """``{label: {"step": [...], "eval": [...], "stats": [...], "meta": {...}}}``."""
    runs = {}
    for path in paths:
        run = {"step": [], "eval": [], "stats": [], "meta": {}, "summary": None}
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
                event = record.get("event")
                if event == "start":
                    run["meta"] = record
                elif event in ("step", "eval"):
                    run[event].append(record)
                elif event == "summary":
                    run["summary"] = record
                elif "bytes_per_channel" in record and "started_s" in record:
                    run["stats"].append(record)
        meta = run["meta"]
        label = (f"{meta['model']} / {meta['kvstore']}" if "model" in meta
                 else os.path.splitext(os.path.basename(path))[0])
        while label in runs:
            label += "'"
        runs[label] = run
    return runs


def plot_runs(runs: Dict[str, dict], out_dir: str) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the installation
        raise SystemExit("dgt.plot needs matplotlib: pip install 'dgt[examples]'") from None
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def figure(name, title, xlabel, ylabel, series):
        series = [(label, xs, ys) for label, xs, ys in series if xs]
        if not series:
            return
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, xs, ys in series:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    figure("accuracy_vs_time.png", "Test accuracy vs wall time", "seconds", "accuracy",
           [(k, [e["time_s"] for e in r["eval"]], [e["accuracy"] for e in r["eval"]])
            for k, r in runs.items()])
    figure("accuracy_vs_step.png", "Test accuracy vs step", "step", "accuracy",
           [(k, [e["step"] for e in r["eval"]], [e["accuracy"] for e in r["eval"]])
            for k, r in runs.items()])
    figure("loss_vs_step.png", "Training loss vs step", "step", "loss",
           [(k, [e["step"] for e in r["step"]], [e["loss"] for e in r["step"]])
            for k, r in runs.items()])
    channel_series, k_series = [], []
    for label, run in runs.items():
        if run["stats"]:  # DGT_STATS: per-step records, cumulate
            start = run["stats"][0]["started_s"]
            times = [s["started_s"] - start for s in run["stats"]]
            totals, cumulative = None, []
            for s in run["stats"]:
                totals = list(s["bytes_per_channel"]) if totals is None else [
                    a + b for a, b in zip(totals, s["bytes_per_channel"])]
                cumulative.append(totals)
            k_series.append((label, times, [s["k"] for s in run["stats"]]))
        else:  # example curve: cumulative already
            records = [e for e in run["step"] if "bytes_per_channel" in e]
            times = [e["time_s"] for e in records]
            cumulative = [e["bytes_per_channel"] for e in records]
            k_series.append((label, times, [e["k"] for e in records]))
        for channel in range(len(cumulative[0]) if cumulative else 0):
            name = "TCP" if channel == 0 else f"UDP {channel}"
            channel_series.append((f"{label}: {name}", times,
                                   [c[channel] / 1e6 for c in cumulative]))
    figure("bytes_per_channel.png", "Payload bytes sent per channel (cumulative)", "seconds",
           "MB", channel_series)
    figure("k_vs_time.png", "Reliable fraction k", "seconds", "k", k_series)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgt.plot", description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="curve (--log) or DGT_STATS JSON-lines files")
    parser.add_argument("-o", "--out", default="plots", help="output directory (plots)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.logs)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    written = plot_runs(runs, args.out)
    for path in written:
        sys.stdout.write(path + "\n")
    if not written:
        sys.stderr.write("nothing to plot in those files\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
