"""Maps drawn as images: the "jet" colour map, an overlay on the image, the original | heatmap |
overlay panel, and the contact sheet of several maps a row per image; shared by the export
(`vit.tools.rollout`) and the `RolloutLogger` callback (vit.rollout)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont


def resize_map(grid_map: np.ndarray | torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """A (h, w) map resized to (H, W) by bilinear interpolation (pixel centres aligned)."""
    m = torch.as_tensor(grid_map, dtype=torch.float32)[None, None]
    return F.interpolate(m, size=size, mode="bilinear", align_corners=False)[0, 0].numpy()


def to_unit(m: np.ndarray) -> np.ndarray:
    """Min-max scale to [0, 1]; a constant map becomes zeros."""
    lo, hi = float(m.min()), float(m.max())
    return (m - lo) / (hi - lo) if hi > lo else np.zeros_like(m)


def colorize(m: np.ndarray) -> np.ndarray:
    """A [0, 1] map -> RGB uint8 in the "jet" colour map (blue low, red high), written as three ramps."""
    m = np.clip(m, 0.0, 1.0)[..., None]
    rgb = np.clip(1.5 - np.abs(4.0 * m - np.array([3.0, 2.0, 1.0])), 0.0, 1.0)
    return (rgb * 255).round().astype(np.uint8)


def overlay(image: np.ndarray, m: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """Blend the coloured [0, 1] map (same H, W as the image) onto an RGB uint8 image."""
    blended = (1 - alpha) * image.astype(np.float32) + alpha * colorize(m).astype(np.float32)
    return blended.round().astype(np.uint8)


def fit(image: np.ndarray, size: int) -> np.ndarray:
    """An RGB uint8 image resized (bicubic) so its longer side is `size`, its aspect ratio kept (a square:
    size x size; a NaFlex image on a 3 x 5 patch grid: 3/5 size x size)."""
    height, width = image.shape[:2]
    scale = size / max(height, width)
    shape = (max(1, round(width * scale)), max(1, round(height * scale)))
    return np.asarray(Image.fromarray(image).resize(shape, Image.Resampling.BICUBIC))


def render_panel(
    image: np.ndarray, grid_map: np.ndarray, lines: Sequence[str] = (), panel_size: int = 224
) -> Image.Image:
    """original | heatmap | overlay, each the image's aspect ratio with its longer side panel_size
    (`fit`), with caption lines underneath.

    `image` is the RGB uint8 region the model saw; the grid map is resized to it bilinearly.
    """
    shown = fit(image, panel_size)
    height, width = shown.shape[:2]
    m = to_unit(resize_map(grid_map, (height, width)))
    font = ImageFont.load_default(size=max(11, panel_size // 16))
    line_height = int(font.size * 1.3) if hasattr(font, "size") else 14
    canvas = Image.new("RGB", (3 * width, height + line_height * len(lines) + 6), "white")
    for i, panel in enumerate((shown, colorize(m), overlay(shown, m))):
        canvas.paste(Image.fromarray(panel), (i * width, 0))
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(lines):
        draw.text((4, height + 3 + i * line_height), line, fill="black", font=font)
    return canvas


COLOUR_SCALE = "relevance, each map scaled to its own min..max:"


def colour_bar(width: int, height: int) -> np.ndarray:
    """The maps' colour scale as an RGB uint8 strip (height, width, 3): lowest at the left, highest at the right."""
    return np.repeat(colorize(np.linspace(0.0, 1.0, width))[None], height, axis=0)


def wrap(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a word wider than that gets a line of its own."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def shorten(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int) -> str:
    """`text`, or its start and end around "...", to fit `width` pixels (a file name keeps its end)."""
    keep = len(text)
    shown = text
    while keep > 1 and font.getlength(shown) > width:
        keep -= 1
        shown = f"{text[: (keep + 1) // 2]}...{text[len(text) - keep // 2 :]}"
    return shown


def contact_sheet(
    rows: Sequence[tuple[np.ndarray, Sequence[np.ndarray], Sequence[str]]],
    titles: Sequence[str],
    panel_size: int = 96,
    header: Sequence[str] = (),
    min_width: int = 0,
) -> Image.Image:
    """One image for a page: the `header` lines (which model, how accurate), the maps' colour scale
    (a bar from low to high), then a row per image (the region the model saw, then its overlay for
    each map, in `titles` order) with its caption lines under the image; `titles` head the columns.
    A cell is panel_size square; an image of another aspect ratio is `fit` into its top-left corner.
    The sheet is at least `min_width` wide; header lines wrap at word boundaries to its width, and a
    caption line wider than it is shortened in the middle. The rows are at the bottom."""
    font = ImageFont.load_default(size=max(10, panel_size // 9))
    line_height = int(font.size * 1.3) if hasattr(font, "size") else 14
    grid_width = max((1 + len(titles)) * panel_size, min_width)
    text = [line for paragraph in [*header, COLOUR_SCALE] for line in wrap(paragraph, font, grid_width - 6)]
    width = max(grid_width, 6 + max(int(font.getlength(line)) + 1 for line in text))
    lines_per_row = max((len(lines) for _, _, lines in rows), default=0)
    row_height = panel_size + line_height * lines_per_row + 6
    bar_top = 2 + line_height * len(text)
    titles_top = bar_top + line_height + 4
    canvas = Image.new("RGB", (width, titles_top + line_height + 4 + row_height * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(text):
        draw.text((3, 2 + i * line_height), line, fill="black", font=font)
    low, high = 3 + int(font.getlength("low ")), width - 3 - int(font.getlength(" high"))
    canvas.paste(Image.fromarray(colour_bar(max(1, high - low), line_height - 4)), (low, bar_top + 2))
    draw.text((3, bar_top), "low", fill="black", font=font)
    draw.text((high + int(font.getlength(" ")), bar_top), "high", fill="black", font=font)
    for c, title in enumerate(["image", *titles]):
        draw.text((c * panel_size + 3, titles_top), title, fill="black", font=font)
    for r, (image, maps, lines) in enumerate(rows):
        if len(maps) != len(titles):
            raise ValueError(f"row {r} has {len(maps)} maps for {len(titles)} titles")
        top = titles_top + line_height + 4 + r * row_height
        shown = fit(image, panel_size)
        canvas.paste(Image.fromarray(shown), (0, top))
        for c, grid_map in enumerate(maps, 1):
            m = to_unit(resize_map(grid_map, shown.shape[:2]))
            canvas.paste(Image.fromarray(overlay(shown, m)), (c * panel_size, top))
        for i, line in enumerate(lines):
            draw.text(
                (3, top + panel_size + 3 + i * line_height), shorten(line, font, width - 6), fill="black", font=font
            )
    return canvas


def denormalise(x: torch.Tensor, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> np.ndarray:
    """A normalised (3, H, W) input back to RGB uint8 (H, W, 3); min-max scaled when mean/std are unknown."""
    x = x.detach().float().cpu()
    if mean is not None and std is not None:
        x = x * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    else:
        x = (x - x.min()) / (x.max() - x.min() + 1e-12)
    return (x.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
