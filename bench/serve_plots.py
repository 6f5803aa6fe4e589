"""``tandem bench serve --plot DIR``: three PNGs drawn with matplotlib (Agg), imported only here.

* ``pareto.png``: output tokens/s per rank against interactivity (tokens/s one user sees, 1000 /
  median TPOT ms), one labelled point per concurrency: up and to the right is better, and the
  curve is what the deployment trades between the two;
* ``ttft_composition.png``: the bills' mean time to first token, stacked by where it went
  (``serve_stats.TTFT_PARTS``), one bar per point, the bills' mean TTFT and the client's median
  marked on it (the stack falls short of the bill's TTFT by the flights between processes);
* ``throughput_split.png``: tokens/s per point, stacked: cached input, new input, output.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tandem.bench.serve_report import point_name
from tandem.bench.serve_stats import TTFT_PARTS
from tandem.wire.request_params import InvalidRequestError


def check_matplotlib() -> None:
    """A clear refusal, naming the flag, when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidRequestError(
            "--plot", "needs matplotlib, which is not installed (pip install 'tandem[bench]')"
        ) from None


def _nan_to_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def write_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """The three figures of ``result`` in ``folder`` (made if missing); their paths."""
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    points = result["points"]
    names = [point_name(p) for p in points]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = [p["interactivity_tokens_per_s"] for p in points]
    ys = [p["per_rank"]["output_tokens_per_s"] for p in points]
    ax.plot(xs, ys, marker="o")
    for x, y, name in zip(xs, ys, names, strict=True):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("interactivity, tokens/s per user (1000 / median TPOT ms)")
    ax.set_ylabel("output tokens/s per rank")
    ax.set_title("throughput per rank against interactivity")
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, folder / "pareto.png"))

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottom = [0.0] * len(points)
    for part in TTFT_PARTS:
        key = part.removesuffix("_s")
        heights = [_nan_to_zero(p["composition_ms"][key]) for p in points]
        ax.bar(names, heights, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    # the stack falls short of the bill's TTFT by the flights between processes (no one clock's)
    bill_ttft = [_nan_to_zero(p["composition_ms"]["ttft"]) for p in points]
    client_ttft = [_nan_to_zero(p["ttft_ms"]["p50"]) for p in points]
    ax.scatter(
        names, bill_ttft, color="black", marker="_", s=300, label="bill TTFT (frontend), mean", zorder=3
    )
    ax.scatter(names, client_ttft, color="black", marker="x", s=60, label="client TTFT p50", zorder=3)
    ax.set_ylabel("ms (mean over completed requests)")
    ax.set_title("time to first token, by where it went (bills)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(fig, folder / "ttft_composition.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    bottom = [0.0] * len(points)
    for label, heights in (
        ("input, cached", [p["input_tokens_per_s"]["cached"] for p in points]),
        ("input, new", [p["input_tokens_per_s"]["new"] for p in points]),
        ("output", [p["output_tokens_per_s"] for p in points]),
    ):
        ax.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("tokens/s (whole deployment)")
    ax.set_title("throughput: cached input, new input, output")
    ax.legend(fontsize="small")
    paths.append(_save(fig, folder / "throughput_split.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
