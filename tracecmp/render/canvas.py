"""Writes a :class:`~tracecmp.render.dot.Drawing` (tracecmp's own graph layout) as SVG or PNG, and
draws DOT text that way (:func:`draw`) where graphviz's ``dot`` is missing.

SVG needs nothing. PNG is drawn with Pillow (``pip install 'tracecmp[png]'``), supersampled for
smooth lines, in DejaVu Sans or Liberation Sans where the system has them, else in Pillow's own
font; text is fitted to the width the layout measured for it.

>>> from tracecmp.render.dot import layout
>>> to_svg(layout("digraph { a -> b; }"))[:4]
'<svg'
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from html import escape
from typing import Any

from tracecmp.errors import TracecmpError
from tracecmp.render.dot.drawing import Drawing, Shape
from tracecmp.render.dot.labels import text_width
from tracecmp.render.dot.sugiyama import layout

_FONT_FAMILY = "Helvetica,Arial,sans-serif"
_DASHES = {"dashed": (5.0, 3.0), "dotted": (1.0, 3.0)}


def _bezier_points(points: list[tuple[float, float]], steps: int = 12) -> list[tuple[float, float]]:
    """A cubic Bézier path (start, then control, control, end per segment) as a polyline."""
    out = [points[0]]
    for k in range(1, len(points) - 2, 3):
        p0, p1, p2, p3 = points[k - 1], points[k], points[k + 1], points[k + 2]
        for s in range(1, steps + 1):
            t = s / steps
            a, b, c, d = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3
            out.append((a * p0[0] + b * p1[0] + c * p2[0] + d * p3[0], a * p0[1] + b * p1[1] + c * p2[1] + d * p3[1]))
    return out


# --- SVG ------------------------------------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _svg_shape(shape: Shape) -> str:
    stroke = (
        f' stroke="{shape.stroke}" stroke-width="{_num(shape.width)}"'
        + (
            f' stroke-dasharray="{",".join(_num(d * max(shape.width, 1.0)) for d in _DASHES[shape.dash])}"'
            if shape.dash
            else ""
        )
        if shape.stroke
        else ' stroke="none"'
    )
    fill = f' fill="{shape.fill}"' if shape.fill else ' fill="none"'
    title = f"<title>{escape(shape.title)}</title>" if shape.title else ""
    if shape.kind in ("rect", "ellipse"):
        (x0, y0), (x1, y1) = shape.points
        if shape.kind == "ellipse":
            body = f'<ellipse cx="{_num((x0 + x1) / 2)}" cy="{_num((y0 + y1) / 2)}" rx="{_num((x1 - x0) / 2)}" ry="{_num((y1 - y0) / 2)}"'
        else:
            body = f'<rect x="{_num(x0)}" y="{_num(y0)}" width="{_num(x1 - x0)}" height="{_num(y1 - y0)}"' + (
                f' rx="{_num(shape.radius)}"' if shape.radius else ""
            )
        return f"{body}{fill}{stroke}>{title}</{shape.kind}>" if title else f"{body}{fill}{stroke}/>"
    if shape.kind == "path":
        p = shape.points
        d = f"M{_num(p[0][0])},{_num(p[0][1])}" + "".join(
            f"C{_num(p[k][0])},{_num(p[k][1])} {_num(p[k + 1][0])},{_num(p[k + 1][1])} {_num(p[k + 2][0])},{_num(p[k + 2][1])}"
            for k in range(1, len(p) - 2, 3)
        )
        return f'<path d="{d}" fill="none"{stroke}/>'
    if shape.kind == "polygon":
        points = " ".join(f"{_num(x)},{_num(y)}" for x, y in shape.points)
        return f'<polygon points="{points}"{fill}{stroke}/>'
    if shape.kind == "text":
        ((x, y),) = shape.points
        weight = ' font-weight="bold"' if shape.bold else ""
        # The layout measured Helvetica; where the browser falls back to a wider font, textLength
        # keeps the text inside the box it was given.
        length = text_width(shape.text, shape.size, shape.bold)
        return (
            f'<text x="{_num(x)}" y="{_num(y)}" font-family="{_FONT_FAMILY}" font-size="{_num(shape.size)}"'
            f'{weight} fill="{shape.fill or "#000000"}" textLength="{_num(length)}" lengthAdjust="spacingAndGlyphs"'
            f' xml:space="preserve">{escape(shape.text)}</text>'
        )
    raise TracecmpError(f"cannot draw a {shape.kind!r}")


def to_svg(drawing: Drawing) -> str:
    """The drawing as a standalone SVG document (sized in points, like graphviz's)."""
    w, h = _num(drawing.width), _num(drawing.height)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}pt" height="{h}pt" viewBox="0 0 {w} {h}">',
        "<!-- drawn by tracecmp's own layout (graphviz dot is not installed) -->",
        f'<rect x="0" y="0" width="{w}" height="{h}" fill="{drawing.background}" stroke="none"/>',
    ]
    for group in drawing.groups:
        parts.append(f'<g class="{group.kind}"><title>{escape(group.name)}</title>')
        parts.extend(_svg_shape(shape) for shape in group.shapes)
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# --- PNG ------------------------------------------------------------------------------------------

_FONT_FILES = {
    False: ("DejaVuSans.ttf", "LiberationSans-Regular.ttf", "Arial.ttf", "arial.ttf"),
    True: ("DejaVuSans-Bold.ttf", "LiberationSans-Bold.ttf", "Arial Bold.ttf", "arialbd.ttf"),
}


@lru_cache(maxsize=None)
def _font(size: int, bold: bool) -> Any:
    from PIL import ImageFont

    for name in _FONT_FILES[bold]:
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow before 10.1: one bitmap size
        return ImageFont.load_default()


def _dashed(points: list[tuple[float, float]], pattern: tuple[float, float]) -> list[list[tuple[float, float]]]:
    """A polyline cut into its dashes."""
    on, off = pattern
    pieces: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = [points[0]]
    drawing, left = True, on
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        length = math.hypot(x1 - x0, y1 - y0)
        pos = 0.0
        while length - pos > left:
            pos += left
            point = (x0 + (x1 - x0) * pos / length, y0 + (y1 - y0) * pos / length)
            if drawing:
                current.append(point)
                pieces.append(current)
            else:
                current = [point]
            drawing = not drawing
            left = on if drawing else off
        left -= length - pos
        if drawing:
            current.append((x1, y1))
    if drawing and len(current) > 1:
        pieces.append(current)
    return pieces


def _outline(shape: Shape) -> list[tuple[float, float]]:
    (x0, y0), (x1, y1) = shape.points
    if shape.kind == "ellipse":
        cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
        return [(cx + rx * math.cos(t / 48 * 2 * math.pi), cy + ry * math.sin(t / 48 * 2 * math.pi)) for t in range(49)]
    r = min(shape.radius, (x1 - x0) / 2, (y1 - y0) / 2)
    corners = ((x1 - r, y0 + r, -90), (x1 - r, y1 - r, 0), (x0 + r, y1 - r, 90), (x0 + r, y0 + r, 180))
    out = []
    for cx, cy, start in corners:
        for s in range(7):
            t = math.radians(start + 15 * s)
            out.append((cx + r * math.cos(t), cy + r * math.sin(t)))
    return out + [out[0]]


def to_png(drawing: Drawing, scale: float = 1.5, supersample: int = 2) -> bytes:
    """The drawing as PNG bytes, ``scale`` pixels per point (needs Pillow)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError as exc:
        raise TracecmpError(
            "drawing a PNG without graphviz needs Pillow: pip install 'tracecmp[png]' (or pillow), "
            "install graphviz, or ask for .svg"
        ) from exc
    k = scale * supersample
    size = (max(1, round(drawing.width * k)), max(1, round(drawing.height * k)))
    image = Image.new("RGB", size, drawing.background)
    pen = ImageDraw.Draw(image)

    def pts(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * k, y * k) for x, y in points]

    def line(points: list[tuple[float, float]], color: str, width: float, dash: str) -> None:
        pieces = _dashed(points, tuple(d * max(width, 1.0) for d in _DASHES[dash])) if dash else [points]  # type: ignore[arg-type]
        for piece in pieces:
            pen.line(pts(piece), fill=color, width=max(1, round(width * k)), joint="curve")

    for shape in drawing.shapes:
        if shape.kind in ("rect", "ellipse"):
            outline = _outline(shape)
            if shape.fill:
                pen.polygon(pts(outline), fill=shape.fill)
            if shape.stroke:
                line(outline, shape.stroke, shape.width, shape.dash)
        elif shape.kind == "path":
            line(_bezier_points(shape.points), shape.stroke or "#000000", shape.width, shape.dash)
        elif shape.kind == "polygon":
            pen.polygon(pts(shape.points), fill=shape.fill, outline=shape.stroke)
        elif shape.kind == "text":
            ((x, y),) = shape.points
            want = text_width(shape.text, shape.size, shape.bold) * k
            px = max(4, round(shape.size * k))
            font = _font(px, shape.bold)
            actual = font.getlength(shape.text) if hasattr(font, "getlength") else want
            if actual > want > 0:  # the system font is wider than Helvetica: fit the measured box
                font = _font(max(4, int(px * want / actual)), shape.bold)
            pen.text((x * k, y * k), shape.text, fill=shape.fill or "#000000", font=font, anchor="ls")
    image = image.resize((max(1, round(size[0] / supersample)), max(1, round(size[1] / supersample))), Image.LANCZOS)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def draw(text: str, fmt: str) -> bytes:
    """The DOT digraph ``text`` drawn as ``fmt`` ("svg" or "png"), as ``dot -T<fmt>`` would.

    >>> draw("digraph { a -> b; }", "svg")[:4]
    b'<svg'
    """
    drawing = layout(text)
    if fmt == "svg":
        return to_svg(drawing).encode("utf-8")
    if fmt == "png":
        return to_png(drawing)
    raise TracecmpError(f"cannot draw {fmt!r} without graphviz: use svg or png")
