"""A small dataflow picture of a plan: an SVG string, drawn without matplotlib or network.

Runs of consecutive stages on one device (``Plan.segments()``) are boxes, top to bottom in chain
order, coloured by device; each cross-device edge is an arrow labelled with the bytes that cross
it per token; the sampled token ids going back from the head to the embedding's device (when
they differ) are the arrow on the right. Devices over their memory cap get a red outline.

A fragmented plan (more than ``MAX_BOXES`` segments, e.g. stages dealt to devices in turn) is
drawn compactly instead: the chain as one strip of runs coloured by device, and one legend line
per device with its number of stages and runs, so the picture stays one screen high.
"""
from __future__ import annotations

import html

from tfnb.names import format_bytes, format_span, short_device
from tfnb.placement.cost import TOKEN_BYTES

__all__ = ["plan_svg", "device_colors", "MAX_BOXES"]

# Colour-blind-safe qualitative palette (Okabe & Ito), light enough for black text.
_PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f4a3b4", "#cdb4db", "#e9c46a", "#a8dadc",
            "#f6bd60")
_W, _BOX_W, _GAP, _X = 300, 200, 30, 10
MAX_BOXES = 16       # more segments than this: the compact strip
_STRIP_H, _STRIP_W = 400, 36


def device_colors(devices) -> dict[str, str]:
    """A fill colour per device, stable for a given device order.

    Examples
    --------
    >>> device_colors(["a", "b"])
    {'a': '#8ecae6', 'b': '#ffb703'}
    """
    return {d: _PALETTE[i % len(_PALETTE)] for i, d in enumerate(devices)}


def plan_svg(plan, chain, devices=None, over=()) -> str:
    """The dataflow of ``plan`` over ``chain`` as an SVG document (a string).

    Parameters
    ----------
    plan : tfnb.placement.Plan
    chain : tfnb.models.LayerChain
        The chain the plan places (for the bytes each stage sends on).
    devices : sequence of str, optional
        Device order that fixes the colours (default: the plan's devices).
    over : collection of str
        Devices over their memory cap (outlined in red).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> from tfnb.placement import Plan
    >>> chain = tiny("llama").chain
    >>> p = Plan({"embed": "a", "block.0": "a", "block.1": "b", "head": "b"})
    >>> svg = plan_svg(p, chain)
    >>> svg.startswith("<svg") and "256 B/token" in svg and "4 B/token" in svg
    True
    """
    segs = plan.segments()
    colors = device_colors(devices if devices is not None else plan.devices)
    if len(segs) > MAX_BOXES:
        return _strip_svg(segs, chain, colors, over)
    heights = [min(34 + 5 * (len(s.stages) - 1), 110) for s in segs]
    tops, y = [], 8
    for h in heights:
        tops.append(y)
        y += h + _GAP
    total_h = y - _GAP + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="tfnb-dataflow" width="{_W}" '
             f'height="{total_h}" viewBox="0 0 {_W} {total_h}" font-family="sans-serif" '
             'font-size="11">',
             '<defs><marker id="tfnb-arrow" viewBox="0 0 10 10" refX="9" refY="5" '
             'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
             '<path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>']
    mid = _X + _BOX_W / 2
    for k, (seg, top, h) in enumerate(zip(segs, tops, heights)):
        bad = seg.device in over
        label = short_device(seg.device) + (" - over memory" if bad else "")
        tip = f"{seg.device}: {', '.join(seg.stages)}"
        parts.append(
            f'<g class="tfnb-segment" data-device="{html.escape(seg.device)}">'
            f'<title>{html.escape(tip)}</title>'
            f'<rect x="{_X}" y="{top}" width="{_BOX_W}" height="{h}" rx="5" '
            f'fill="{colors.get(seg.device, "#ddd")}" stroke="{"#c00" if bad else "#333"}" '
            f'stroke-width="{3 if bad else 1}"/>'
            f'<text x="{mid}" y="{top + h / 2 - 3}" text-anchor="middle">'
            f'{html.escape(format_span(seg.stages))}</text>'
            f'<text x="{mid}" y="{top + h / 2 + 11}" text-anchor="middle" font-weight="bold" '
            f'fill="{"#c00" if bad else "#000"}">{html.escape(label)}</text>'
            '</g>')
        if k + 1 < len(segs):
            nbytes = chain[seg.stages[-1]].act_bytes_out_per_token
            y0, y1 = top + h, tops[k + 1]
            parts.append(
                f'<line class="tfnb-edge" x1="{mid}" y1="{y0}" x2="{mid}" y2="{y1 - 1}" '
                'stroke="#333" marker-end="url(#tfnb-arrow)"/>'
                f'<text x="{mid + 8}" y="{(y0 + y1) / 2 + 4}">{format_bytes(nbytes)}/token</text>')
    if len(segs) > 1 and segs[0].device != segs[-1].device:
        y_from, y_to = tops[-1] + heights[-1] / 2, tops[0] + heights[0] / 2
        x_out, x_turn = _X + _BOX_W, _X + _BOX_W + 40
        parts.append(
            f'<path class="tfnb-edge tfnb-return" d="M{x_out},{y_from} H{x_turn} V{y_to} '
            f'H{x_out + 1}" fill="none" stroke="#333" stroke-dasharray="4 3" '
            'marker-end="url(#tfnb-arrow)"/>'
            f'<text x="{x_turn + 6}" y="{(y_from + y_to) / 2}" '
            f'transform="rotate(90 {x_turn + 6} {(y_from + y_to) / 2})" text-anchor="middle">'
            f'{format_bytes(TOKEN_BYTES)}/token (token ids)</text>')
    parts.append("</svg>")
    return "".join(parts)


def _strip_svg(segs, chain, colors, over) -> str:
    """Many segments: the chain as a strip of runs, and one legend line per device."""
    n = sum(len(s.stages) for s in segs)
    per_stage = _STRIP_H / n
    crossing = sum(chain[s.stages[-1]].act_bytes_out_per_token for s in segs[:-1])
    devs = list(dict.fromkeys(s.device for s in segs))
    stages = {d: sum(len(s.stages) for s in segs if s.device == d) for d in devs}
    runs = {d: sum(s.device == d for s in segs) for d in devs}
    legend_h = 22 * len(devs)
    total_h = max(_STRIP_H, legend_h + 40) + 36
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="tfnb-dataflow tfnb-strip" '
             f'width="{_W + 60}" height="{total_h}" viewBox="0 0 {_W + 60} {total_h}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="{_X}" y="14">{len(segs)} segments, {len(segs) - 1} hops: '
             f'{format_bytes(crossing)}/token between devices</text>']
    y = 24.0
    for seg in segs:
        h = per_stage * len(seg.stages)
        parts.append(f'<rect class="tfnb-run" x="{_X}" y="{y:.2f}" width="{_STRIP_W}" '
                     f'height="{h:.2f}" fill="{colors.get(seg.device, "#ddd")}">'
                     f'<title>{html.escape(short_device(seg.device))}: '
                     f'{html.escape(format_span(seg.stages))}</title></rect>')
        y += h
    parts.append(f'<rect x="{_X}" y="24" width="{_STRIP_W}" height="{_STRIP_H}" fill="none" '
                 'stroke="#333"/>'
                 f'<text x="{_X}" y="{24 + _STRIP_H + 16}">{html.escape(segs[0].stages[0])} '
                 f'(top) .. {html.escape(segs[-1].stages[-1])} (bottom), {n} stages</text>')
    x = _X + _STRIP_W + 14
    for k, dev in enumerate(devs):
        bad = dev in over
        top = 30 + 22 * k
        parts.append(
            f'<g class="tfnb-legend" data-device="{html.escape(dev)}">'
            f'<rect x="{x}" y="{top}" width="14" height="14" fill="{colors.get(dev, "#ddd")}" '
            f'stroke="{"#c00" if bad else "#333"}" stroke-width="{3 if bad else 1}"/>'
            f'<text x="{x + 20}" y="{top + 11}" fill="{"#c00" if bad else "#000"}">'
            f'{html.escape(short_device(dev))}: {stages[dev]} stages in {runs[dev]} runs'
            f'{" - over memory" if bad else ""}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
