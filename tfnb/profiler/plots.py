"""Matplotlib views of a :class:`~tfnb.profiler.profile.Profile` (figures only: no server, no
window, no pyplot state; callers show or save the returned Figure)."""
from __future__ import annotations

from tfnb.errors import ProfileError
from tfnb.names import short_device
from tfnb.profiler.xplane import COMPILED_KINDS

COLORS = {"compute": "#4c78a8", "compile": "#9d755d", "send/receive": "#f58518", "idle": "#d9d9d9"}


def _new(nrows=1, ncols=1, size=(7.0, 3.0)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def busy(prof, ax, fractions: dict | None = None) -> None:
    """Stacked horizontal bars per device: compute, send/receive, idle (ms); ``fractions``
    (``{device: fraction of its memory-bandwidth bound}``) adds that under a device's name."""
    rows = prof.busy()
    fractions = fractions or {}
    labels = [short_device(r["device"]) + (f"\n{fractions[r['device']]:.0%} of bound"
                                           if fractions.get(r["device"]) else "") for r in rows]
    left = [0.0] * len(rows)
    compiled = any(r["compile_ms"] for r in rows)
    for key, cat in (("compute_ms", "compute"), ("compile_ms", "compile"),
                     ("send_recv_ms", "send/receive"), ("idle_ms", "idle")):
        if cat == "compile" and not compiled:
            continue
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
        for cat in ("compute", "compile", "send/receive"):
            spans = ([(c["start"] / 1e6, c["dur"] / 1e6) for c in prof.compile_spans()
                      if c["device"] == dev]
                     if cat == "compile" else
                     [(e.start / 1e6, max(e.dur / 1e6, 1e-4)) for e in prof.events[:max_ops]
                      if e.device == dev and e.category == cat])
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=COLORS[cat],
                               label=cat if i == 0 else None)
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
                ax.text(j, i, f"{nbytes[i][j] / 1024:.1f} KiB\n{count[i][j]}x", ha="center",
                        va="center", fontsize=7)
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


KIND_COLORS = dict(zip(COMPILED_KINDS, ("#4c78a8", "#e45756", "#72b7b2", "#54a24b", "#b279a2",
                                         "#f58518", "#bab0ac")))


def slowest(rows) -> tuple[dict, str, float] | None:
    """The slowest stage row (per decode step when it decoded, else in all), its largest op
    kind and that kind's share of the stage; None without rows."""
    if not rows:
        return None
    per = [(r["ms_per_step"] if r.get("ms_per_step") else r["measured_ms"], r) for r in rows]
    _, row = max(per, key=lambda x: x[0])
    kinds = (row.get("step_kinds") if row.get("ms_per_step") else None) or row.get("kinds") or {}
    if not kinds:
        return row, "", 0.0
    kind = max(kinds, key=kinds.get)
    return row, kind, kinds[kind] / max(sum(kinds.values()), 1e-12)


def stages(prof, ax, plan=None, predicted=None) -> None:
    """Per stage: time per decode step (all its time when it did not decode) stacked by op kind,
    the planner's predicted time as a black tick; the title names the slowest stage and kind."""
    rows = prof.stage_times(plan, predicted)
    xs = list(range(len(rows)))
    # per decode step where the stage decoded, else its time in the whole block
    shown = [(r.get("step_kinds") if r.get("ms_per_step") else None) or r.get("kinds") or {}
             for r in rows]
    bottom = [0.0] * len(rows)
    kinds = [k for k in KIND_COLORS if any(k in sh for sh in shown)]
    for kind in kinds:
        vals = [sh.get(kind, 0.0) for sh in shown]
        ax.bar(xs, vals, 0.8, bottom=bottom, color=KIND_COLORS[kind], label=kind)
        bottom = [a + b for a, b in zip(bottom, vals)]
    if not kinds:  # stages of the caller's own: one bar each
        ax.bar(xs, [r["measured_ms"] for r in rows], 0.8, color=COLORS["compute"], label="measured")
    pred = [(x, r["predicted_ms"]) for x, r in zip(xs, rows) if r.get("predicted_ms") is not None]
    if pred:
        ax.scatter([x for x, _ in pred], [v for _, v in pred], marker="_", s=120, color="black",
                   zorder=3, label="predicted")
    step = -(-len(rows) // 16)  # a label per stage up to 16 stages, then every n-th
    ax.set_xticks(xs[::step], [str(r["stage"]) for r in rows][::step], rotation=60, ha="right",
                  fontsize="small")
    decoded = any(r.get("ms_per_step") for r in rows)
    ax.set_ylabel("ms per decode step" if decoded else "ms")
    found = slowest(rows)
    row, kind, share = found
    title = f"slowest stage: {row['stage']} ({short_device(row['device'])})"
    ax.set_title(title + (f", {kind} {share:.0%}" if kind else ""), fontsize="medium")
    top = max([b for b in bottom] + [v for _, v in pred]
              + [r["measured_ms"] for r in rows if not kinds] + [1e-6])
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.legend(fontsize="x-small", ncol=4, loc="upper left")


def bound(prof, ax, models=None, bandwidth=None) -> None:
    """Per device: the measured time of a decode step beside its memory-bandwidth bound."""
    rows = [r for r in prof.bound(models, bandwidth=bandwidth, links=False)["devices"]
            if r["ms_per_step"]]
    if not rows:
        raise ProfileError("plot('bound'): no decode step of a placed model was traced in this "
                           "profile")
    labels = [short_device(r["device"]) for r in rows]
    ys = list(range(len(rows)))
    ax.barh([y - 0.2 for y in ys], [r["ms_per_step"] for r in rows], 0.4, color=COLORS["compute"],
            label="measured")
    ax.barh([y + 0.2 for y in ys], [r["bound_ms"] or 0 for r in rows], 0.4, color="#999999",
            label="bound: bytes read / bandwidth")
    for y, r in zip(ys, rows):
        text = f" {r['fraction']:.0%} of bound" if r["fraction"] is not None else " bound unknown"
        ax.text(r["ms_per_step"], y - 0.2, text, va="center", fontsize="small")
    ax.set_yticks(ys, labels)
    ax.set_xlim(0, 1.3 * max(max(r["ms_per_step"], r["bound_ms"] or 0) for r in rows))
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    ax.set_title("decode step against the memory-bandwidth bound")
    ax.legend(fontsize="x-small", loc="lower right")


def figure(prof, kind: str = "summary", **kwargs):
    """The Figure for ``Profile.plot``."""
    single = {"busy": busy, "timeline": timeline, "transfers": transfers, "stages": stages,
              "top_ops": top_ops, "bound": bound}
    if kind == "summary":
        fig, axes = _new(2, 2, (12.0, 7.0))
        fractions = ({r["device"]: r["fraction"] for r in prof.bound(links=False)["devices"]}
                     if prof.compiled_stages() else None)
        busy(prof, axes[0][0], fractions)
        timeline(prof, axes[0][1])
        transfers(prof, axes[1][0], kwargs.get("function"))
        if kwargs.get("plan") is not None or prof.compiled_stages():
            stages(prof, axes[1][1], kwargs.get("plan"), kwargs.get("predicted"))
        else:
            top_ops(prof, axes[1][1])
        return fig
    if kind not in single:
        raise ProfileError(f"kind={kind!r}; expected summary, {', '.join(single)}")
    if kind == "stages":
        if kwargs.get("plan") is None and not prof.compiled_stages():
            raise ProfileError("plot('stages'): no compiled op of a tfnb stage was traced; pass "
                               "plan={stage: device} to time stages of your own")
        n = len(prof.stage_times(kwargs.get("plan"), kwargs.get("predicted")))
        fig, axes = _new(size=(min(16.0, 4.0 + 0.25 * n), 4.0))
    else:
        fig, axes = _new(size=(7.0, 0.6 * len(prof.devices) + 2.0) if kind != "transfers"
                         else (6.0, 5.0))
    single[kind](prof, axes[0][0], **kwargs)
    return fig
