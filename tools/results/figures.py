"""Pillow drawing for the toolkit's figures, in one place: canvas, fonts, text placement, thumbnails of the data's
images (read only from inside the data folder: `DataImages`), the atomic PNG write, the shared colours."""

from __future__ import annotations

import base64
import io
import logging
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError

from tools.data.layout import data_file
from tools.errors import UserError, option
from tools.provenance import atomic_write

log = logging.getLogger(__name__)

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1)

WHITE = (255, 255, 255)
TEXT = (20, 20, 20)
MUTED = (100, 100, 100)
PLACEHOLDER = (200, 200, 200)
AXIS = (40, 40, 40)
GRID = (225, 225, 225)
LABEL_STEP = 14  # how far a label moves, per try, to clear the labels drawn before it
LABEL_TRIES = 12


def default_font(size: int):
    """Pillow's default font at `size` points (the bitmap font on old Pillow)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1 has one fixed-size bitmap font
        return ImageFont.load_default()


def new_canvas(size: tuple[int, int]) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A white RGB image of `size` (width, height) and its drawing context."""
    canvas = Image.new("RGB", size, WHITE)
    return canvas, ImageDraw.Draw(canvas)


def text_box(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font, anchor: str) -> tuple:
    """The (x, y) to draw `text` at so its box sits at `at` as `anchor` (l/m/r, t/m/b) says, and that box (bitmap
    fonts lack Pillow's anchors)."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    w, h = right - left, bottom - top
    x = at[0] - {"l": 0, "m": w / 2, "r": w}[anchor[0]] - left
    y = at[1] - {"t": 0, "m": h / 2, "b": h}[anchor[1]] - top
    return (x, y), (x + left, y + top, x + right, y + bottom)


def draw_text(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font, anchor: str,
              fill: tuple[int, int, int] = TEXT) -> None:
    """`text` with its box placed at `at` by `anchor` (see `text_box`)."""
    draw.text(text_box(draw, at, text, font, anchor)[0], text, font=font, fill=fill)


def centered_text(draw: ImageDraw.ImageDraw, box: Box, text: str, font, fill: tuple[int, int, int] = TEXT) -> None:
    x0, y0, x1, y1 = box
    draw_text(draw, ((x0 + x1) / 2, (y0 + y1) / 2), text, font, "mm", fill)


def free_text_position(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font, anchor: str,
                       taken: list[Box]) -> tuple[float, float]:
    """Where to draw a label near `at` so it overlaps none in `taken` (its box is added to `taken`)."""
    for step in range(LABEL_TRIES):
        shifted = (at[0], at[1] + LABEL_STEP * ((step + 1) // 2) * (1 if step % 2 else -1))
        position, box = text_box(draw, shifted, text, font, anchor)
        if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in taken):
            break
    taken.append(box)
    return position


def paste_vertical_text(canvas: Image.Image, at: tuple[int, int], size: tuple[int, int], text: str, font) -> None:
    """`text` reading upwards in a white strip of `size` (length, thickness), its top-left corner at `at`."""
    strip, draw = new_canvas(size)
    draw_text(draw, (size[0] / 2, size[1] / 2), text, font, "mm")
    canvas.paste(strip.rotate(90, expand=True), at)


def square(image: Image.Image, size: int) -> Image.Image:
    """`image` as RGB, cropped and scaled to a `size` square."""
    return ImageOps.fit(image.convert("RGB"), (size, size), Image.Resampling.LANCZOS)


class DataImages:
    """The data files a figure or report shows, named relative to `root` (the data folder the command was given),
    each read only when a regular file inside it once links are resolved; the refused ones warned about once."""

    def __init__(self, root: Path | str | None):
        self.root = None if root is None else Path(root)
        self.refused: list[str] = []

    def path(self, relpath: str) -> Path:
        """The file `relpath` names, checked; a UserError (recorded for `warn`) when it may not be read."""
        try:
            if self.root is None:
                raise UserError(f"no data folder is known (pass {option('--data-path', 'DIR')})")
            return data_file(self.root, relpath)
        except UserError as exc:
            self.refused.append(str(exc))
            raise

    def thumbnail(self, relpath: str, size: int) -> Image.Image | None:
        """The image `relpath` names, cropped and scaled to a `size` square; None when it may not or cannot be read."""
        try:
            with Image.open(self.path(relpath)) as img:
                return square(img, size)
        except (UserError, OSError, UnidentifiedImageError, ValueError):
            return None

    def warn(self, what: str = "image(s)") -> None:
        """One warning for the files refused so far, if any."""
        if self.refused:
            log.warning("%d %s named by the results not shown: %s%s", len(self.refused), what, self.refused[0],
                        f" (and {len(self.refused) - 1} more)" if len(self.refused) > 1 else "")
            self.refused = []


def data_uri(image: Image.Image, fmt: str = "JPEG", quality: int = 80) -> str:
    """`image` encoded as a base64 data URI (JPEG at `quality`, or PNG), for a self-contained HTML page."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": quality} if fmt == "JPEG" else {"optimize": True}))
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


def save_png(canvas: Image.Image, path: Path | str) -> None:
    """Write `canvas` to `path` as PNG, whole or not at all."""
    with atomic_write(path, "wb") as fh:
        canvas.save(fh, format="PNG")
