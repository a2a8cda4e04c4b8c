"""The plots of a run (matplotlib, imported only when a plot is drawn): throughput against N,
memory and time against N, decode time against Nk; one PNG a suite."""
import math

from .cases import predicted_peak_for


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plain_number(y):
    return f"{y:,.0f}" if y >= 1000 else f"{y:g}"


def _plain_log_y(ax):
    """Log y axis labelled with plain numbers (0.06, 20, 3,000) instead of 6x10^-2."""
    from matplotlib import ticker

    class Plain(ticker.LogFormatter):
        def __call__(self, x, pos=None):  # keep LogFormatter's choice of which ticks get labels
            return _plain_number(x) if super().__call__(x, pos) else ""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _method_colors(records):
    """One colour per method, the same in every panel (numflash methods first)."""
    import matplotlib
    names = sorted({r["method"] for r in records},
                   key=lambda m: (not m.startswith("numflash"), m))
    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(names)}


def _panels(records, keyfn):
    keys = []
    for r in records:
        k = keyfn(r)
        if k not in keys:
            keys.append(k)
    return keys


def _panel_grid(plt, n):
    """A figure with n panels, at most 4 a row."""
    cols = min(4, n)
    rows = math.ceil(n / cols)
    return plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)


def _save(plt, fig, path, title):
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _method_lines(ax, records, colors, point):
    """One line a method through ``point(r)`` = (x, y) of its ok records (numflash solid, peers
    dashed); its FAIL records as red crosses."""
    for m in _panels(records, lambda r: r["method"]):
        pts = sorted(point(r) + (r["status"],) for r in records if r["method"] == m)
        ok = [(x, y) for x, y, s in pts if s == "ok"]
        ax.plot([x for x, _ in ok], [y for _, y in ok], "-" if m.startswith("numflash") else "--",
                marker="o", ms=4, color=colors[m], label=m)
        bad = [(x, y) for x, y, s in pts if s == "FAIL"]
        if bad:
            ax.plot([x for x, _ in bad], [y for _, y in bad], "x", color="red", ms=9, mew=2,
                    label=f"{m} FAIL")


def _method_panels(records, path, title, panel_of, point, panel_title, xlabel, ylabel,
                   grid_which="major"):
    """One panel a value of ``panel_of(r)`` over the ok and FAIL records, a line a method through
    ``point(r)`` on log axes; None when there is nothing to plot."""
    plt = _pyplot()
    recs = [r for r in records if r["status"] in ("ok", "FAIL")]
    keys = _panels(recs, panel_of)
    if not keys:
        return None
    colors = _method_colors(recs)
    fig, axes = _panel_grid(plt, len(keys))
    for ax, key in zip(axes.flat, keys):
        _method_lines(ax, [r for r in recs if panel_of(r) == key], colors, point)
        ax.set_title(panel_title(*key), fontsize=10)
        ax.set_xscale("log", base=2)
        _plain_log_y(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which=grid_which, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    return _save(plt, fig, path, title)


def plot_throughput(records, path, title):
    """TFLOP/s vs N per method, one panel per (d, dtype, causal); FAIL points marked with x."""
    return _method_panels(records, path, title, lambda r: (r["d"], r["dtype"], r["causal"]),
                          lambda r: (r["Nq"], r["tflops"]),
                          lambda d, dt, c: f"d={d} {dt}{' causal' if c else ''}",
                          "N (sequence length)", "TFLOP/s (log scale)")


def plot_memory(records, path, title, device_bytes=None):
    """Peak memory and time vs N on log axes per method, io_model predictions dashed, OOM marked."""
    plt = _pyplot()
    recs = [r for r in records if r["status"] != "skipped"]
    methods = _panels(recs, lambda r: r["method"])
    if not methods:
        return None
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = _method_colors(recs)
    for m in methods:
        sub = sorted((r for r in recs if r["method"] == m), key=lambda r: r["Nq"])
        good = [r for r in sub if r["status"] in ("ok", "FAIL") and r.get("memory")]
        line, = ax_m.plot([r["Nq"] for r in good], [r["memory"]["peak_bytes"] / 2 ** 20
                                                    for r in good], marker="o", color=colors[m],
                          label=f"{m} measured")
        pred = [(r["Nq"], predicted_peak_for(r)) for r in sub]
        pred = [(n, p) for n, p in pred if p]
        if pred:
            ax_m.plot([n for n, _ in pred], [p / 2 ** 20 for _, p in pred], ":",
                      color=line.get_color(), label=f"{m} io_model")
        oom = [r for r in sub if r["status"] == "OOM"]
        if oom:
            first = oom[0]
            y = (predicted_peak_for(first) or (device_bytes or 1)) / 2 ** 20
            ax_m.plot([r["Nq"] for r in oom], [(predicted_peak_for(r) or y * 2 ** 20) / 2 ** 20
                                               for r in oom], "X", color="red", ms=10,
                      label=f"{m} OOM")
            ax_m.annotate(f"naive OOM from N={first['Nq']}", (first["Nq"], y),
                          textcoords="offset points", xytext=(-12, -4), ha="right", va="top",
                          color="red", fontsize=8)
        timed = [r for r in sub if r["status"] == "ok"]
        ax_t.plot([r["Nq"] for r in timed], [r["time_ms"]["median"] for r in timed], marker="o",
                  color=line.get_color(), label=m)
    if device_bytes:
        ax_m.axhline(device_bytes / 2 ** 20, color="gray", lw=1, ls="--", label="device memory")
    for ax, ylabel in ((ax_m, "peak extra memory (MiB)"), (ax_t, "median time (ms)")):
        ax.set_xscale("log", base=2)
        _plain_log_y(ax)
        ax.set_xlabel("N (sequence length)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_decode(records, path, title):
    """Median time vs Nk per method on log axes, one panel per (Nq, d, dtype)."""
    return _method_panels(records, path, title, lambda r: (r["Nq"], r["d"], r["dtype"]),
                          lambda r: (r["Nk"], r["time_ms"]["median"]),
                          lambda nq, d, dt: f"Nq={nq} d={d} {dt}",
                          "Nk (keys)", "median time (ms)", grid_which="both")


def plot_suite(suite, records, path, meta):
    """The plot of one suite's records (None when there is nothing to plot)."""
    title = f"numflash {suite}: {meta['device']} ({meta['date'][:10]})"
    if suite == "memory":
        return plot_memory(records, path, title, (meta.get("device_info") or {}).get("memory bytes"))
    if suite == "decode":
        return plot_decode(records, path, title)
    return plot_throughput(records, path, title)

