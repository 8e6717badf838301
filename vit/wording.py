"""How our messages say a count: "1 image", "2 images", "1.5 minutes"."""

from __future__ import annotations


def counted(count: float, noun: str, plural: str | None = None) -> str:
    """The count and its noun, singular for exactly one: `counted(1, "image")` is "1 image",
    `counted(1200, "image")` "1,200 images", `counted(0.5, "minute")` "0.5 minutes"."""
    number = f"{count:,}" if isinstance(count, int) else f"{count:,g}"
    return f"{number} {noun if count == 1 else plural or noun + 's'}"
