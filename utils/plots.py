"""Pictures of a run: labelled image grids, predict.py's annotated images and contact sheets (PIL), the confusion
matrix and results.png (matplotlib, imported only when a plot is drawn, as it costs a second or two of start-up)."""

import csv
import functools
import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from utils.once import atomic_write

LABEL_HEIGHT = 12  # pixels of caption under each tile
THUMBNAIL_SIDE = 128  # pixels of a contact sheet's square tiles


def labelled_grid(images, labels, columns=8, min_side=64):
    """A (3, H, W) uint8 grid of uint8 (N, C, H, W) images, each captioned with its label; small images are
    enlarged (nearest neighbour, so their pixels stay visible) to at least min_side."""
    n, _, h, w = images.shape
    scale = max(1, math.ceil(min_side / max(h, w)))
    tile_w, tile_h = w * scale, h * scale + LABEL_HEIGHT
    columns = min(columns, n)
    canvas = Image.new("RGB", (columns * (tile_w + 2), math.ceil(n / columns) * (tile_h + 2)), "white")
    draw, font = ImageDraw.Draw(canvas), label_font(10)
    for i, (image, label) in enumerate(zip(images, labels)):
        x, y = (i % columns) * (tile_w + 2), (i // columns) * (tile_h + 2)
        tile = Image.fromarray(image.expand(3, -1, -1).permute(1, 2, 0).numpy())
        canvas.paste(tile.resize((tile_w, tile_h - LABEL_HEIGHT), Image.NEAREST), (x, y))
        draw.text((x + 1, y + tile_h - LABEL_HEIGHT), fit_text(draw, font, label, tile_w - 2), fill="black", font=font)
    return torch.from_numpy(np.array(canvas)).permute(2, 0, 1)


def fit_text(draw, font, text, width):
    """text, shortened with '..' until it fits width pixels."""
    while len(text) > 1 and draw.textlength(text, font=font) > width:
        text = text[:-3] + ".." if len(text) > 3 else text[:-1]
    return text


@functools.lru_cache
def label_font(size):
    """DejaVu Sans at size pixels, from matplotlib's files (found without importing it): it draws accented Latin,
    Greek and Cyrillic class names ('crème brûlée'), where Pillow's built-in font draws only ASCII. That built-in
    font where the file is missing."""
    spec = importlib.util.find_spec("matplotlib")
    try:
        return ImageFont.truetype(Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf", size)
    except (AttributeError, OSError):  # no matplotlib, or no file
        return ImageFont.load_default(size)


def annotated_image(image, lines, min_side=256):
    """An RGB copy of a PIL image with lines of text on a semi-opaque box at its top left, readable on any image;
    an image whose shorter side is below min_side is first enlarged by a whole factor (nearest neighbour: an 8x8
    digit stays sharp). The text scales with the image, as in yolov5's detect.py."""
    scale = max(1, math.ceil(min_side / min(image.size)))
    image = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.NEAREST)
    font = label_font(max(12, round((image.width + image.height) / 2 * 0.035)))
    margin = max(2, font.size // 4)
    draw = ImageDraw.Draw(image, "RGBA")  # RGBA fills blend into the RGB image
    text = "\n".join(fit_text(draw, font, line, image.width - 4 * margin) for line in lines)
    box = draw.multiline_textbbox((2 * margin, 2 * margin), text, font=font)
    draw.rectangle((margin, margin, box[2] + margin, box[3] + margin), fill=(0, 0, 0, 160))
    draw.multiline_text((2 * margin, 2 * margin), text, font=font, fill="white")
    return image


def contact_sheet(images, captions, side=THUMBNAIL_SIDE, columns=10):
    """One PIL image of PIL images as side x side thumbnails (whole, centred on white; nearest neighbour when
    enlarged), columns to a row, each captioned as labelled_grid() does."""
    tiles = [ImageOps.pad(image.convert("RGB"), (side, side), Image.NEAREST if max(image.size) < side else
                          Image.BILINEAR, color="white") for image in images]
    grid = labelled_grid(torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2), captions, columns, side)
    return Image.fromarray(grid.permute(1, 2, 0).numpy())


def confusion_figure(confusion, classes):
    """A matplotlib Figure of the confusion matrix, each row (true class) normalised to sum to 1, labelled with
    the class names (up to 50 classes) and with the shares in the cells (up to 20)."""
    from matplotlib.figure import Figure

    counts = confusion.double()
    shares = (counts / counts.sum(1, keepdim=True).clamp(min=1)).numpy()
    c = len(classes)
    side = min(4 + 0.35 * c, 24)
    fig = Figure(figsize=(side + 1.5, side), dpi=100)
    ax = fig.add_subplot()
    im = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if c <= 50:
        ax.set_xticks(range(c), [str(n) for n in classes], rotation=90, fontsize=8)
        ax.set_yticks(range(c), [str(n) for n in classes], fontsize=8)
    if c <= 20:
        for (i, j), share in np.ndenumerate(shares):
            if share > 0:
                ax.text(j, i, f"{share:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if share > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix ({int(counts.sum())} images; rows sum to 1)")
    fig.tight_layout()
    return fig


def figure_array(fig):
    """A matplotlib Figure rendered to an (H, W, 3) uint8 array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_figure(fig, path):
    """Save a Figure as a PNG atomically: a viewer never sees half a file."""
    path = Path(path)
    with atomic_write(path, suffix=".png") as tmp:  # savefig picks the format by the name's end
        fig.savefig(tmp)


def results_figure(csv_path):
    """results.png's Figure: losses, val top-1/balanced top-1/top-5 (multi-label: mAP, F1, precision, recall and
    exact match) and learning rate against epochs, from results.csv."""
    from matplotlib.figure import Figure

    with open(csv_path, newline="") as f:
        rows = [row for row in csv.DictReader(f)]
    epochs = [int(r["epoch"]) for r in rows]
    fig = Figure(figsize=(13, 3.6), dpi=100)
    scores = (("val mAP and F1", ["val/map", "val/f1", "val/precision", "val/recall", "val/exact_match",
                                  "val/ema_map"]) if rows and "val/map" in rows[0] else
              ("val accuracy", ["val/top1", "val/balanced_top1", "val/top5", "val/ema_top1", "val/ema_top5"]))
    panels = (("loss", ["train/loss", "val/loss", "val/ema_loss"]), scores, ("learning rate", ["lr/pg0"]))
    for ax, (title, columns) in zip(fig.subplots(1, 3), panels):
        for column in columns:
            values = [float(r[column]) if r.get(column) else np.nan for r in rows]
            if not all(np.isnan(values)):
                ax.plot(epochs, values, marker=".", label=column)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig
