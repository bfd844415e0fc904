"""Benchmark plots (matplotlib, Agg backend): quality vs TTFT, vs recompute ratio, vs chunks."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt

COLORS = {
    "full_recompute": "tab:red",
    "full_recompute_saved": "tab:pink",
    "prefix_caching": "tab:orange",
    "full_reuse": "tab:gray",
    "map_reduce": "tab:purple",
    "map_rerank": "tab:brown",
}

MARKERS = "osD^v<>ph*XP"


def method_styles(methods: list[str]) -> dict[str, dict]:
    """A marker and colour per method, in order, for plots whose legend names the points (methods
    that tie sit on top of each other, so labels beside the points overlap)."""
    cmap = plt.get_cmap("tab20")
    return {m: dict(marker=MARKERS[i % len(MARKERS)], color=cmap(i % 20)) for i, m in enumerate(methods)}


def _color(method: str) -> str:
    return COLORS.get(method, "tab:blue")


def _ratio(method: str) -> float | None:
    if not method.startswith("cacheblend@") or ":" in method:
        return None
    try:
        return float(method.split("@")[1])
    except ValueError:
        return None


def _grid(n: int, rows: int = 1, size=(4.0, 3.2)):
    fig, axes = plt.subplots(rows, n, figsize=(size[0] * n, size[1] * rows), squeeze=False)
    return fig, axes


def make_plots(summary: list[dict], out: Path, dpi: int = 80) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    datasets = sorted({r["dataset"] for r in summary})
    top_ks = sorted({r["top_k"] for r in summary})
    main_k = 6 if 6 in top_ks else top_ks[-1]
    paths = []

    # 1. The paper's main figure: quality against time to first token, one point per method.
    methods = list(dict.fromkeys(r["method"] for r in summary if r["top_k"] == main_k))
    style = method_styles(methods)
    fig, axes = _grid(len(datasets))
    handles = {}
    for ax, d in zip(axes[0], datasets):
        rows = [r for r in summary if r["dataset"] == d and r["top_k"] == main_k]
        blend = sorted((r for r in rows if _ratio(r["method"]) is not None), key=lambda r: _ratio(r["method"]))
        if blend:
            ax.plot([r["ttft_mean_s"] for r in blend], [r["quality"] for r in blend], "-", color="tab:blue", alpha=0.4)
        for r in rows:
            handles[r["method"]] = ax.scatter(r["ttft_mean_s"], r["quality"], s=36, **style[r["method"]])
        ax.set_xscale("log")
        ax.set_title(f"{d} (top-{main_k})", fontsize=9)
        ax.set_xlabel("time to first token (s, log)")
        ax.set_ylabel(rows[0]["metric"] if rows else "quality")
        ax.grid(alpha=0.3)
    fig.legend(
        [handles[m] for m in methods if m in handles], [m for m in methods if m in handles], loc="center right", fontsize=7
    )
    fig.tight_layout(rect=(0, 0, 0.78 if len(datasets) > 1 else 0.65, 1))
    paths.append(out / "quality_vs_ttft.png")
    fig.savefig(paths[-1], dpi=dpi)
    plt.close(fig)

    # 2. Quality, TTFT and (when measured) next-token KL to full prefill against the recompute
    # ratio, full prefill / full reuse as references. KL is the sensitive fidelity measure where a
    # small model's answer F1 is near zero for every method.
    keys = ["quality", "ttft_mean_s"]
    if any(r.get("kl_mean") is not None and _ratio(r["method"]) is not None for r in summary):
        keys.append("kl_mean")
    labels = {"ttft_mean_s": "TTFT (s)", "kl_mean": "KL(full prefill || method)"}
    fig, axes = _grid(len(datasets), rows=len(keys))
    for j, d in enumerate(datasets):
        rows = [r for r in summary if r["dataset"] == d and r["top_k"] == main_k]
        blend = sorted((r for r in rows if _ratio(r["method"]) is not None), key=lambda r: _ratio(r["method"]))
        for i, key in enumerate(keys):
            ax = axes[i][j]
            pts = [(_ratio(r["method"]), r[key]) for r in blend if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:blue", label="cacheblend")
            for ref in ("full_recompute", "full_reuse", "prefix_caching"):
                for r in rows:
                    if r["method"] == ref and r.get(key) is not None:
                        ax.axhline(r[key], color=_color(ref), ls="--", lw=1, label=ref)
            ax.set_xlabel("recompute ratio")
            ax.set_ylabel(labels.get(key, rows[0]["metric"] if rows else "quality"))
            if i == 0:
                ax.set_title(f"{d} (top-{main_k})", fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    paths.append(out / "vs_ratio.png")
    fig.savefig(paths[-1], dpi=dpi)
    plt.close(fig)

    # 3. Against the number of retrieved chunks (only when several top-k were run).
    if len(top_ks) > 1:
        fig, axes = _grid(len(datasets), rows=2)
        for j, d in enumerate(datasets):
            rows = [r for r in summary if r["dataset"] == d]
            for i, key in enumerate(("quality", "ttft_mean_s")):
                ax = axes[i][j]
                for m in sorted({r["method"] for r in rows}):
                    pts = sorted((r["top_k"], r[key]) for r in rows if r["method"] == m)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=_color(m), label=m, alpha=0.8)
                ax.set_xlabel("retrieved chunks")
                ax.set_ylabel((rows[0]["metric"] if rows else "quality") if key == "quality" else "TTFT (s)")
                if i == 0:
                    ax.set_title(d, fontsize=9)
        axes[0][0].legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / "vs_chunks.png")
        fig.savefig(paths[-1], dpi=dpi)
        plt.close(fig)
    return paths


def escalation_plot(groups: dict[str, tuple[list[dict], list[dict]]], path: Path, dpi: int = 80) -> Path:
    """Agreement with full prefill against the mean TTFT's speed-up over the saved full prefill,
    one panel per dataset: ``groups[dataset] = (fixed, frontier)``, the fixed-ratio methods as
    points and the adaptive cascades on the frontier (``bench.guard_curve.frontier``) as a line."""
    fig, axes = _grid(len(groups))
    for ax, (dataset, (fixed, front)) in zip(axes[0], groups.items()):
        ax.plot(
            [e["speedup_vs_saved"] for e in front],
            [100 * e["agree"] for e in front],
            "-o",
            color="tab:blue",
            markersize=3,
            label="adaptive (frontier)",
        )
        for e in fixed:
            ax.plot(e["speedup_vs_saved"], 100 * e["agree"], "s", color="tab:orange")
            ax.annotate(
                e["methods"][0], (e["speedup_vs_saved"], 100 * e["agree"]), fontsize=6, xytext=(3, -8), textcoords="offset points"
            )
        ax.set_xlabel("mean TTFT: speed-up vs saved full prefill")
        ax.set_ylabel("answer = full prefill's (%)")
        ax.set_title(f"{dataset} ({front[0]['n']} questions)" if front else dataset, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
