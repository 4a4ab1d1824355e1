"""Matplotlib views of a :class:`~tfnb.profiler.profile.Profile` (figures only: no server, no
window, no pyplot state; callers show or save the returned Figure)."""
from __future__ import annotations

from tfnb.errors import ProfileError
from tfnb.names import short_device

COLORS = {"compute": "#4c78a8", "send/receive": "#f58518", "idle": "#d9d9d9"}


def _new(nrows=1, ncols=1, size=(7.0, 3.0)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def busy(prof, ax) -> None:
    """Stacked horizontal bars per device: compute, send/receive, idle (ms)."""
    rows = prof.busy()
    labels = [short_device(r["device"]) for r in rows]
    left = [0.0] * len(rows)
    for key, cat in (("compute_ms", "compute"), ("send_recv_ms", "send/receive"), ("idle_ms", "idle")):
        vals = [r[key] for r in rows]
        ax.barh(labels, vals, left=left, color=COLORS[cat], label=cat)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("ms in the profiled block")
    ax.set_title("time per device")
    ax.legend(loc="lower right", fontsize="small")


def timeline(prof, ax, max_ops: int = 20000) -> None:
    """One lane per device; ops as boxes coloured by category, on the merged time axis."""
    lanes = prof.devices
    for i, dev in enumerate(lanes):
        for cat in ("compute", "send/receive"):
            spans = [(e.start / 1e6, max(e.dur / 1e6, 1e-4)) for e in prof.events[:max_ops]
                     if e.device == dev and e.category == cat]
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=COLORS[cat], label=cat if i == 0 else None)
    ax.set_yticks(range(len(lanes)), [short_device(d) for d in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, max(prof.wall_ms, 1e-3))
    ax.set_xlabel("ms since the block started")
    ax.set_title("timeline")


def transfers(prof, ax, function=None) -> None:
    """Heatmap of bytes sent, source (rows) x destination (columns)."""
    devs, nbytes, count = prof.transfer_matrix(function)
    im = ax.imshow(nbytes, cmap="Oranges")
    names = [short_device(d) for d in devs]
    ax.set_xticks(range(len(devs)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(devs)), names)
    for i in range(len(devs)):
        for j in range(len(devs)):
            if count[i][j]:
                ax.text(j, i, f"{nbytes[i][j] / 1024:.1f} KiB\n{count[i][j]}x", ha="center", va="center", fontsize=7)
    ax.set_xlabel("destination")
    ax.set_ylabel("source")
    ax.set_title("bytes transferred")
    ax.figure.colorbar(im, ax=ax, shrink=0.8)


def top_ops(prof, ax, n: int = 8) -> None:
    rows = prof.top_ops(n, by="op")
    ax.barh([r["op"] for r in rows], [r["total_ms"] for r in rows], color=COLORS["compute"])
    ax.invert_yaxis()
    ax.set_xlabel("ms (summed over threads)")
    ax.set_title("top op types")


def stages(prof, ax, assignment, predicted=None) -> None:
    """Measured (and predicted, when given) time per stage."""
    rows = prof.stage_times(assignment, predicted)
    xs = range(len(rows))
    width = 0.4 if predicted else 0.8
    ax.bar([x - (width / 2 if predicted else 0) for x in xs], [r["measured_ms"] for r in rows], width,
           label="measured", color=COLORS["compute"])
    if predicted:
        ax.bar([x + width / 2 for x in xs], [r.get("predicted_ms") or 0 for r in rows], width,
               label="predicted", color="#999999")
    ax.set_xticks(list(xs), [str(r["stage"]) for r in rows], rotation=30, ha="right")
    ax.set_ylabel("ms")
    ax.set_title("time per stage")
    ax.legend(fontsize="small")


def figure(prof, kind: str = "summary", **kwargs):
    """The Figure for ``Profile.plot``."""
    single = {"busy": busy, "timeline": timeline, "transfers": transfers, "stages": stages, "top_ops": top_ops}
    if kind == "summary":
        fig, axes = _new(2, 2, (12.0, 7.0))
        busy(prof, axes[0][0])
        timeline(prof, axes[0][1])
        transfers(prof, axes[1][0], kwargs.get("function"))
        if "assignment" in kwargs:
            stages(prof, axes[1][1], kwargs["assignment"], kwargs.get("predicted"))
        else:
            top_ops(prof, axes[1][1])
        return fig
    if kind not in single:
        raise ProfileError(f"kind={kind!r}; expected summary, {', '.join(single)}")
    if kind == "stages" and "assignment" not in kwargs:
        raise ProfileError("plot('stages') needs assignment={stage: device} (and optionally predicted=)")
    fig, axes = _new(size=(7.0, 0.6 * len(prof.devices) + 2.0) if kind != "transfers" else (6.0, 5.0))
    single[kind](prof, axes[0][0], **kwargs)
    return fig
