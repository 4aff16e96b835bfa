"""PNG line plots for the evaluations. matplotlib is optional (the `eval` extra) and imported
only when a plot is asked for, so the engine never depends on it."""
from __future__ import annotations


def line_panels(path: str, panels: list[dict], title: str = "") -> None:
    """One row of panels; each panel is {"title", "xlabel", "ylabel", "x", "series": {label: ys},
    optional "xlog": bool, "xticks": labels}. Writes a PNG to `path`."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plots need matplotlib: pip install 'oasiskv[eval]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, ys in p["series"].items():
            ax.plot(p["x"], ys, marker="o", markersize=3, label=label)
        if p.get("xlog"):
            ax.set_xscale("log")
        if p.get("xticks"):
            ax.minorticks_off()  # a log axis would label its minor ticks over ours
            ax.set_xticks(p["x"], p["xticks"])
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel(p["xlabel"])
        ax.set_ylabel(p["ylabel"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
