"""A picture of a manifest in plain SVG: per-rank memory bars for both layouts, and the last flips as
a per-rank timeline of their components. No dependency beyond the standard library.

Owns: `render_svg(manifest) -> str`.
"""
from __future__ import annotations

from html import escape

COLORS = {"arena": "#4e79a7", "kv_usable": "#59a14f", "kv_unusable": "#b07aa1", "graph_pool": "#f28e2b",
          "static_buffers": "#edc948", "staging_reserve": "#76b7b2", "host_images": "#9c755f",
          "framework_overhead": "#bab0ac", "compiled_code": "#ff9da7", "allocator_cache": "#d4a6c8",
          "unexplained": "#e15759", "read": "#4e79a7", "exchange": "#f28e2b", "refill": "#e15759",
          "write": "#59a14f", "cutover": "#b07aa1"}
USED = ("arena", "kv_usable", "kv_unusable", "graph_pool", "compiled_code", "static_buffers", "staging_reserve",
        "host_images", "allocator_cache", "framework_overhead", "unexplained")  # unexplained: drawn when > 0
W, LEFT, RIGHT = 1000, 150, 230   # RIGHT: room for the text after a bar


def _text(x, y, s, size=12, anchor="start", weight="normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-family="sans-serif" font-size="{size}" '
            f'text-anchor="{anchor}" font-weight="{weight}">{escape(str(s))}</text>')


def _rect(x, y, w, h, color, title) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h}" fill="{color}" '
            f'stroke="white" stroke-width="0.5"><title>{escape(title)}</title></rect>')


def _legend(y, names) -> tuple[list[str], float]:
    """Colour keys, wrapped onto as many lines as they need; returns them and the next free y."""
    out, x = [], LEFT
    for n in names:
        width = 22 + 7 * len(n)
        if x + width > W - 20:
            x, y = LEFT, y + 16
        out += [_rect(x, y - 10, 12, 12, COLORS[n], n), _text(x + 16, y, n, 11)]
        x += width
    return out, y + 16


def memory_bars(m: dict, y0: float) -> tuple[list[str], float]:
    rows = [(r, lay) for r in m["ranks"] for lay in m["layouts"]]
    used = [sum(max(0, r["ledger"][lay].get(t) or 0) for t in USED) for r, lay in rows]
    scale = (W - LEFT - RIGHT) / max(max(used), 1)
    out = [_text(20, y0, "Memory per rank and layout (bar = what is used; free shown as text)", 15, weight="bold")]
    legend, y = _legend(y0 + 26, USED)
    out += legend
    for (r, lay), total in zip(rows, used):
        ledger = r["ledger"][lay]
        out.append(_text(20, y + 14, f"rank {r['rank']} {lay}", 12))
        x = LEFT
        for t in USED:
            v = max(0, ledger.get(t) or 0)
            out.append(_rect(x, y, v * scale, 20, COLORS[t], f"{t}: {v / 2**20:.1f} MiB"))
            x += v * scale
        free = ledger["free"]
        out.append(_text(x + 6, y + 14, f"{total / 2**20:.0f} MiB used, "
                         + ("free not measured" if free is None else f"{free / 2**30:.1f} GiB free"), 11))
        y += 28
    return out, y + 10


def _timeline(per_rank: dict) -> list[tuple[str, float, float]]:
    """(component, start, length) in ms: read, then exchange with refill beside it, write, cutover."""
    read, ex, rf = per_rank.get("read") or 0, per_rank.get("exchange") or 0, per_rank.get("refill") or 0
    write, cut = per_rank.get("write") or 0, per_rank.get("cutover") or 0
    after = read + max(ex, rf)
    return [("read", 0, read), ("exchange", read, ex), ("refill", read, rf), ("write", after, write),
            ("cutover", after + write, cut)]


def flip_timelines(m: dict, y0: float, last: int = 4) -> tuple[list[str], float]:
    flips = [f for f in m["flips"] if f.get("per_rank")][-last:]
    out = [_text(20, y0, f"Last {len(flips)} flips: per-rank timeline of the components (ms)", 15, weight="bold")]
    if not flips:
        return out + [_text(LEFT, y0 + 24, "no flips in this manifest", 12)], y0 + 40
    legend, y = _legend(y0 + 26, ("read", "exchange", "refill", "write", "cutover"))
    out += legend
    longest = max(max(s + w for _, s, w in _timeline(pr)) for f in flips for pr in f["per_rank"])
    scale = (W - LEFT - RIGHT) / max(longest, 1e-6)
    for f in flips:
        out.append(_text(20, y + 10, f"{f['direction']} {f['total_ms']:.0f} ms" + ("" if f["ok"] else " FAILED"),
                         12, weight="bold"))
        y += 16
        for pr in f["per_rank"]:
            out.append(_text(40, y + 12, f"rank {pr['rank']}", 11))
            for name, start, width in _timeline(pr):
                dy = 8 if name == "refill" else 0   # the refill runs beside the exchange
                out.append(_rect(LEFT + start * scale, y + dy, width * scale, 8, COLORS[name],
                                 f"{name}: {width:.1f} ms"))
            y += 20
        y += 6
    return out, y


def render_svg(m: dict) -> str:
    title = (f"phaseflip: {m['model']['architecture']} {m['dtype']} on {m['world_size']} rank(s), "
             f"layouts {', '.join(m['layouts'])}")
    parts = [_text(20, 24, title, 16, weight="bold")]
    bars, y = memory_bars(m, 56)
    timeline, y = flip_timelines(m, y + 10)
    parts += bars + timeline
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y + 20:.0f}" '
            f'viewBox="0 0 {W} {y + 20:.0f}"><rect width="100%" height="100%" fill="white"/>'
            + "".join(parts) + "</svg>\n")
