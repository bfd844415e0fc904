"""Draws docs/img/how_it_works.png, the figure of docs/how-it-works.md (no measurements in it).

python3 docs/img/make_diagram.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

OUT = Path(__file__).with_name("how_it_works.png")
GREY, BLUE, ORANGE, GREEN = "#d9d9d9", "#9ecae1", "#fdae6b", "#a1d99b"


def box(ax, x, y, w, h, color, text="", fs=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.05", fc=color, ec="#555555", lw=0.8))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs)


def prompt_row(ax, y, label, fresh_cols=None, stale=False):
    """One prompt: instruction, three chunks of 10 tokens, question."""
    ax.text(-0.15, y + 0.2, label, ha="right", va="center", fontsize=9)
    box(ax, 0, y, 1.0, 0.4, GREEN, "instruction")
    x = 1.1
    for c in range(3):
        for t in range(10):
            fresh = fresh_cols is None or (c, t) in fresh_cols
            color = ORANGE if fresh else (BLUE if not stale else BLUE)
            ax.add_patch(plt.Rectangle((x + t * 0.2, y), 0.18, 0.4, fc=color, ec="white", lw=0.5))
        ax.text(x + 1.0, y + 0.55, f"chunk {c + 1}", ha="center", fontsize=8)
        x += 2.15
    box(ax, x, y, 1.0, 0.4, GREEN, "question")


fig, ax = plt.subplots(figsize=(9, 3.6))
ax.set_xlim(-2.2, 9.0)
ax.set_ylim(0.35, 4.6)
ax.axis("off")

prompt_row(ax, 3.6, "full prefill")
prompt_row(ax, 2.2, "full KV reuse", fresh_cols=set())
picked = {(1, 2), (1, 3), (1, 7), (2, 0), (2, 4), (2, 5), (2, 8), (2, 9)}
prompt_row(ax, 0.8, "CacheBlend", fresh_cols=picked)

ax.text(3.45, 4.45, "every token computed: exact, slow", ha="center", fontsize=9, style="italic")
ax.text(
    3.45,
    3.05,
    "chunk caches reused as stored: fast, but no chunk saw the chunks before it",
    ha="center",
    fontsize=9,
    style="italic",
)
ax.text(
    3.45,
    1.65,
    "caches reused, keys moved to their new positions (RoPE);\na few tokens per layer recomputed (those the question reads most)",
    ha="center",
    fontsize=9,
    style="italic",
)

handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="#555555") for c in (ORANGE, BLUE, GREEN)]
ax.legend(
    handles,
    ["computed now", "read from the chunk cache", "always computed (short)"],
    loc="lower center",
    bbox_to_anchor=(0.5, -0.02),
    ncol=3,
    fontsize=8,
    frameon=False,
)
fig.tight_layout()
fig.savefig(OUT, dpi=130)
print("wrote", OUT)
