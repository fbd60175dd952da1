"""Bounding boxes: reading box files (VOC XML folder or CSV: docs/data.md, build) and carrying boxes through the
resize and crop. Boxes are (x0, y0, x1, y1) pixels, half-open, floats until `pixel_box` rounds them outwards. A
VOC box is named by its XML file's name, not <filename> (some ImageNet files hold a placeholder there)."""

from __future__ import annotations

import codecs
import csv
import io
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
from PIL import Image

from tools.data.variations import Box
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE

RESIZE_SIZE = 256  # the shorter side after resizing, as torchvision's Resize(256) in the original pipeline
CSV_COLUMNS = ("image", "xmin", "ymin", "xmax", "ymax")

FloatBox = tuple[float, float, float, float]


@dataclass
class BoxEntry:
    """The boxes given for one image, and the image size the box file declares (VOC <size>), if any."""

    boxes: list[FloatBox] = field(default_factory=list)
    declared_size: tuple[int, int] | None = None  # (width, height)
    source: str = ""

    def boxes_for(self, width: int, height: int) -> list[FloatBox]:
        """The boxes in the pixels of a width x height image, rescaled when the file declared another size."""
        if self.declared_size is None or self.declared_size == (width, height):
            return list(self.boxes)
        sx, sy = width / self.declared_size[0], height / self.declared_size[1]
        return [(x0 * sx, y0 * sy, x1 * sx, y1 * sy) for x0, y0, x1, y1 in self.boxes]


def read_boxes(path: Path) -> dict[str, BoxEntry]:
    """Image stem -> its boxes, from a folder of VOC XML files or a CSV file."""
    path = Path(path)
    if path.is_dir():
        return _read_voc_folder(path)
    if path.is_file() and path.suffix.lower() == ".csv":
        return _read_csv(path)
    raise UserError(f"--boxes {path} is neither a folder of Pascal VOC .xml files nor a .csv file with the columns "
                    f"{','.join(CSV_COLUMNS)}; pass one of those")


def _read_voc_folder(folder: Path) -> dict[str, BoxEntry]:
    entries: dict[str, BoxEntry] = {}
    for xml_path in sorted(path for path in folder.rglob("*.xml") if path.is_file()):
        stem = xml_path.stem
        if stem in entries:
            raise UserError(f"two box files for image {stem}: {entries[stem].source} and {xml_path}; keep one")
        entries[stem] = _read_voc(xml_path)
    if not entries:
        raise UserError(f"--boxes folder {folder} holds no .xml files; pass a folder of Pascal VOC annotations "
                        f"(ImageNet's bounding boxes) or a CSV file")
    return entries


def _number(element: ET.Element | None, tag: str, where: Path) -> float:
    node = None if element is None else element.find(tag)
    try:
        value = float(node.text)  # type: ignore[union-attr, arg-type]
    except (AttributeError, TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise UserError(f"box file {where} has no finite number in <{tag}>; fix or remove the file")
    return value


def _read_voc(path: Path) -> BoxEntry:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise UserError(f"box file {path} is not valid XML ({exc}); fix or remove the file") from None
    except OSError as exc:
        raise UserError(f"cannot read box file {path}: {exc.strerror or exc}") from None
    entry = BoxEntry(source=str(path))
    size = root.find("size")
    if size is not None and size.find("width") is not None and size.find("height") is not None:
        width, height = int(_number(size, "width", path)), int(_number(size, "height", path))
        if width > 0 and height > 0:
            entry.declared_size = (width, height)
    for obj in root.iter("object"):
        bndbox = obj.find("bndbox")
        xmin, ymin, xmax, ymax = (_number(bndbox, tag, path) for tag in ("xmin", "ymin", "xmax", "ymax"))
        entry.boxes.append((max(xmin - 1, 0.0), max(ymin - 1, 0.0), xmax, ymax))
    return entry


def _csv_text(path: Path) -> str:
    """A CSV file's text: UTF-8 (Excel's byte-order mark dropped) or UTF-16 with its byte-order mark; anything else
    is refused, as its names would be misread."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read box file {path}: {exc.strerror or exc}") from None
    utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    try:
        return raw.decode("utf-16" if utf16 else "utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"box file {path} is not {'UTF-16' if utf16 else 'UTF-8'} text (byte 0x{raw[exc.start]:02x} "
                        f"on line {line}); save it as CSV UTF-8 (in Excel: Save As, CSV UTF-8)") from None


def _read_csv(path: Path) -> dict[str, BoxEntry]:
    entries: dict[str, BoxEntry] = {}
    reader = csv.DictReader(io.StringIO(_csv_text(path), newline=""))
    try:
        header = reader.fieldnames or []
        missing = [c for c in CSV_COLUMNS if c not in header]
        if missing:
            raise UserError(f"box file {path} lacks the column(s) {', '.join(missing)}; its first line must name "
                            f"{','.join(CSV_COLUMNS)}")
        for row in reader:
            fields = [row[c] for c in CSV_COLUMNS]
            if None in fields:
                given = sum(value is not None for key, value in row.items() if key is not None)
                raise UserError(f"box file {path}, line {reader.line_num}: {given} fields where the header names "
                                f"{len(header)}; give every row all of them")
            try:
                box: tuple[float, ...] | None = tuple(float(value) for value in fields[1:])
            except ValueError:
                box = None
            if box is None or not all(math.isfinite(value) for value in box):
                raise UserError(f"box file {path}, line {reader.line_num}: the coordinates must be finite numbers "
                                f"(got {fields[1:]})")
            stem = PurePath(fields[0].strip().replace("\\", "/")).stem
            entries.setdefault(stem, BoxEntry(source=str(path))).boxes.append(box)  # type: ignore[arg-type]
    except csv.Error as exc:
        raise UserError(f"box file {path}, line {reader.line_num}: not valid CSV ({exc})") from None
    return entries


def box_area(box: FloatBox) -> float:
    x0, y0, x1, y1 = box
    return max(0.0, x1 - x0) * max(0.0, y1 - y0)


def clip_box(box: FloatBox, size: int) -> FloatBox:
    """The part of the box inside a size x size image (possibly empty)."""
    x0, y0, x1, y1 = box
    return (min(max(x0, 0.0), size), min(max(y0, 0.0), size), min(max(x1, 0.0), size), min(max(y1, 0.0), size))


def pixel_box(box: FloatBox, size: int) -> Box:
    """The smallest whole-pixel box holding the box, clipped to a size x size image."""
    x0, y0, x1, y1 = box
    return (max(0, math.floor(x0)), max(0, math.floor(y0)), min(size, math.ceil(x1)), min(size, math.ceil(y1)))


@dataclass(frozen=True)
class CropGeometry:
    """torchvision's Resize(256) (bilinear) then CenterCrop(224) for one original image size, in torchvision's
    own arithmetic: `image` gives `CenterCrop(224)(Resize(256)(img))`'s pixels; `box` and `mask` move alike."""

    width: int
    height: int
    resized_width: int
    resized_height: int
    left: int
    top: int
    size: int = IMAGE_SIZE

    @classmethod
    def for_image(cls, width: int, height: int, resize: int = RESIZE_SIZE, size: int = IMAGE_SIZE) -> CropGeometry:
        if resize < size:
            raise ValueError(f"resize ({resize}) must be at least the crop size ({size})")
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = resize, int(resize * long / short)
        new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        top = int(round((new_h - size) / 2.0))
        left = int(round((new_w - size) / 2.0))
        return cls(width, height, new_w, new_h, left, top, size)

    def _crop_rect(self) -> tuple[int, int, int, int]:
        return (self.left, self.top, self.left + self.size, self.top + self.size)

    def image(self, img: Image.Image) -> np.ndarray:
        """The size x size x 3 uint8 crop of an RGB PIL image of this geometry's size."""
        if img.size != (self.width, self.height):
            raise ValueError(f"image is {img.size}, geometry is for {(self.width, self.height)}")
        if img.size != (self.resized_width, self.resized_height):
            img = img.resize((self.resized_width, self.resized_height), Image.BILINEAR)
        return np.asarray(img.crop(self._crop_rect()))

    def mask(self, mask: np.ndarray) -> np.ndarray:
        """A bool mask at the original size, resized by nearest neighbour and cropped like the image."""
        if mask.shape != (self.height, self.width):
            raise ValueError(f"mask is {mask.shape}, geometry is for {(self.height, self.width)}")
        img = Image.fromarray(mask.astype(np.uint8))
        if img.size != (self.resized_width, self.resized_height):
            img = img.resize((self.resized_width, self.resized_height), Image.NEAREST)
        return np.asarray(img.crop(self._crop_rect())) != 0

    def box(self, box: FloatBox) -> FloatBox:
        """A box in original pixels moved into the crop's pixels (not clipped: it may reach outside)."""
        x0, y0, x1, y1 = box
        # multiply before dividing, so an edge that lands on a whole pixel is exactly that number
        rw, w, rh, h = self.resized_width, self.width, self.resized_height, self.height
        return (x0 * rw / w - self.left, y0 * rh / h - self.top, x1 * rw / w - self.left, y1 * rh / h - self.top)
