"""Drift against bytes per token, one point per configuration, the Pareto front marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower bytes, lower drift), by bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best = float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_drift(doc: dict[str, Any], path: str | Path) -> list[int]:
    """Write a PNG of |drift| (with its 95% interval) vs bytes/token; returns the Pareto-front indices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    xs = [float(r["bytes_per_token"]) for r in results]
    ys = [float(r["drift_pct"]) for r in results]
    front = pareto_front(list(zip(xs, ys, strict=True)))
    codecs = sorted(
        {Path(r["kv_cache_dtype"]).name for r in results},
        key=lambda c: (
            -max(x for x, r in zip(xs, results, strict=True) if Path(r["kv_cache_dtype"]).name == c)
        ),
    )
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(codecs)}
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for r, x, y in zip(results, xs, ys, strict=True):
        lo, hi = r["drift_ci95"]
        codec = Path(r["kv_cache_dtype"]).name
        ax.errorbar(
            x, y, yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="o" if r["sinks"] else "s",
            color=colors[codec], ms=4, alpha=0.8, elinewidth=0.8,
        )  # fmt: skip
    for i in front:  # label the front only: sweeps put many points at the same bytes
        label = results[i].get("label", results[i]["kv_cache_dtype"])
        ax.annotate(label, (xs[i], ys[i]), fontsize=7, xytext=(5, 4), textcoords="offset points")
    ax.step([xs[i] for i in front], [ys[i] for i in front], where="post", color="tab:red", lw=1.2)
    ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=70, facecolors="none", edgecolors="tab:red")
    handles = [plt.Line2D([], [], color=colors[c], marker="o", ls="", label=c) for c in codecs]
    handles.append(plt.Line2D([], [], color="tab:red", marker="o", mfc="none", label="Pareto front"))
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.axhline(0.0, color="gray", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.05)
    ax.set_xlabel("cold bytes per token (all layers, K+V, scales included)")
    ax.set_ylabel("perplexity drift vs unquantized (%), symlog; circles: sinks on")
    ax.set_title(f"{doc['model']}: {doc['tokens']} tokens, context {doc.get('context', '?')}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return front
