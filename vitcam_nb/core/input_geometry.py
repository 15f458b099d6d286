"""Where the model's input lies in the user's image: the box of the original that the resize and crop kept, and
the words that state it (the crop warning and the checklist's ``model and input``). Pure arithmetic over sizes, so
the checklist can read a trace's recorded facts without importing torch.

Sizes are (height, width) like the trace's ``img_size``; a box is (x0, y0, x1, y1) in the original's pixels, x to
the right and y down, and may reach outside the original where a step padded it.

Example:
    >>> g = Geometry((200, 300))
    >>> g.resize((248, 372)); g.crop((224, 224))
    >>> [round(v, 1) for v in g.box()], g.cropped()
    ([59.7, 9.7, 240.3, 190.3], True)
"""

from __future__ import annotations

import json

__all__ = ["Geometry", "geometry_text"]

#: Relative difference of the two axes' scales above which the resize counts as stretching the image.
STRETCH_RTOL = 0.01


class Geometry:
    """The map from the current image's pixels back to the original's, step by step: ``orig = scale * cur + shift``
    per axis.

    Example:
        >>> g = Geometry((10, 20)); g.resize((10, 10))
        >>> g.stretched(), g.cropped()
        (True, False)
    """

    def __init__(self, size: tuple[int, int]) -> None:
        self.original = (int(size[0]), int(size[1]))
        self.size = self.original
        self.scale = [1.0, 1.0]  # y, x
        self.shift = [0.0, 0.0]
        self.steps: list[str] = []

    def resize(self, size: tuple[int, int]) -> None:
        """The whole current image scaled to ``size`` (H, W)."""
        size = (int(size[0]), int(size[1]))
        if size == self.size:
            return
        for axis in (0, 1):
            self.scale[axis] *= self.size[axis] / size[axis]
        self.steps.append(f"resized {_hw(self.size)} -> {_hw(size)}")
        self.size = size

    def crop(self, size: tuple[int, int]) -> None:
        """A centred crop to ``size`` (H, W), padding an axis the crop is larger than (torchvision's and timm's
        ``center_crop`` offsets: round((in - out) / 2), or -((out - in) // 2) where it pads)."""
        size = (int(size[0]), int(size[1]))
        if size == self.size:
            return
        for axis in (0, 1):
            before, after = self.size[axis], size[axis]
            offset = -((after - before) // 2) if after > before else int(round((before - after) / 2.0))
            self.shift[axis] += self.scale[axis] * offset
        shrinks, grows = (any(cmp(size[a], self.size[a]) for a in (0, 1)) for cmp in (int.__lt__, int.__gt__))
        how = "cropped/padded" if shrinks and grows else "padded" if grows else "cropped"
        self.steps.append(f"centre-{how} to {_hw(size)}")
        self.size = size

    def box(self) -> list[float]:
        """The model input's box in the original: (x0, y0, x1, y1), rounded to 0.01 px."""
        (sy, sx), (ty, tx) = self.scale, self.shift
        return [round(v, 2) for v in (tx, ty, tx + sx * self.size[1], ty + sy * self.size[0])]

    def cropped(self) -> bool:
        """Whether part of the original lies outside the box (the model does not see it)."""
        x0, y0, x1, y1 = self.box()
        h, w = self.original
        return x0 > 0.005 or y0 > 0.005 or x1 < w - 0.005 or y1 < h - 0.005

    def stretched(self) -> bool:
        """Whether the two axes were scaled differently (the aspect ratio changed)."""
        sy, sx = self.scale
        return abs(sy - sx) > STRETCH_RTOL * max(sy, sx)

    def kept_share(self) -> float:
        """The share of the original's area inside the box."""
        x0, y0, x1, y1 = self.box()
        h, w = self.original
        return max(0.0, min(x1, w) - max(x0, 0.0)) * max(0.0, min(y1, h) - max(y0, 0.0)) / (h * w)

    def facts(self) -> dict:
        """The facts recorded in the trace's ``preprocessing`` attrs."""
        return {"original_size": list(self.original), "geometry": self.steps, "crop_box": self.box(),
                "cropped": self.cropped(), "stretched": self.stretched()}


def _hw(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def geometry_text(preprocessing: object) -> str | None:
    """The checklist's words for the resize and crop recorded in a trace's ``preprocessing`` JSON; None where the
    trace records none (a tensor used as given, traces of earlier versions, an attribute that is no such JSON).

    Example:
        >>> g = Geometry((200, 300)); g.resize((248, 372)); g.crop((224, 224))
        >>> geometry_text(json.dumps(g.facts())).split(";")[0]
        'original 200x300 (HxW), resized 200x300 -> 248x372, centre-cropped to 224x224'
    """
    try:
        facts = json.loads(str(preprocessing))
    except ValueError:  # an edited or foreign attribute: the raw text stays in the 'preprocessing' row
        return None
    if not isinstance(facts, dict) or not isinstance(facts.get("original_size"), list):
        return None
    h, w = (int(v) for v in facts["original_size"][:2])
    steps = facts.get("geometry")
    if not isinstance(steps, list):  # an image processor: its own resize and crop, stated in its facts
        return (f"original {h}x{w} (HxW), resized and cropped by the image processor "
                f"{facts.get('processor', '?')} (see preprocessing)")
    text = f"original {h}x{w} (HxW), " + (", ".join(str(s) for s in steps) or "used at its size")
    box = facts.get("crop_box")
    if facts.get("cropped"):
        text += (f"; the model sees only the box x {box[0]:g}..{box[2]:g}, y {box[1]:g}..{box[3]:g} of the "
                 "original: the map covers that box, not the whole image")
    elif isinstance(box, list) and (box[0] < 0 or box[1] < 0):
        text += "; nothing cropped (padded to the input's shape)"
    else:
        text += "; nothing cropped"
    if facts.get("stretched"):
        text += "; the aspect ratio was changed (the axes scaled differently)"
    return text
