"""A small dataflow picture of a plan: an SVG string, drawn without matplotlib or network.

Runs of consecutive stages on one device (``Plan.segments()``) are boxes, top to bottom in chain
order, coloured by device; each cross-device edge is an arrow labelled with the bytes that cross
it per token; the sampled token ids going back from the head to the embedding's device (when
they differ) are the arrow on the right. Devices over their memory cap get a red outline.
"""
from __future__ import annotations

import html

from tfnb.names import format_bytes, format_span, short_device
from tfnb.placement.cost import TOKEN_BYTES

__all__ = ["plan_svg", "device_colors"]

# Colour-blind-safe qualitative palette (Okabe & Ito), light enough for black text.
_PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f4a3b4", "#cdb4db", "#e9c46a", "#a8dadc",
            "#f6bd60")
_W, _BOX_W, _GAP, _X = 300, 200, 30, 10


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
