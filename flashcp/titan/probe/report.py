"""What a probe run shows: a depth x length heatmap, scalars per length, one summary, a log table.

TensorBoard (the run's own writer, `FlashCPMetrics.tensorboard`): `probe/heatmap` (an image of
accuracy, each cell annotated with its mean answer-token log-probability), `probe/accuracy` (the
mean over cells), `probe/accuracy/<length>` and `probe/logprob/<length>` (means over depths). The
same image is written to `<dump_folder>/probe/step-<N>.png`, and the log gets a compact table.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on a training node
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from torchtitan.tools.logging import logger  # noqa: E402

from flashcp.titan.components.validate import size_name as length_name  # noqa: E402  (4K, 128K, 1M)
from flashcp.titan.probe.score import ProbeResult  # noqa: E402


def scalars(result: ProbeResult) -> dict[str, float]:
    out = {"probe/accuracy": result.mean_accuracy}
    for i, n in enumerate(result.lengths):
        out[f"probe/accuracy/{length_name(n)}"] = float(result.accuracy[i].mean())
        out[f"probe/logprob/{length_name(n)}"] = float(result.logprob[i].mean())
    return out


def table(result: ProbeResult) -> str:
    """Rows: needle depth; columns: prompt length; each cell `accuracy / mean log-prob`."""
    names = [length_name(n) for n in result.lengths]
    width = 13
    lines = ["depth " + "".join(f"{name:>{width}}" for name in names)]
    for j, depth in enumerate(result.depths):
        cells = "".join(f"{result.accuracy[i, j]:>6.2f} {result.logprob[i, j]:>6.2f}" for i in range(len(names)))
        lines.append(f"{depth:>5.2f} {cells}")
    return "\n".join(lines)


def heatmap_png(result: ProbeResult, title: str = "") -> bytes:
    """The accuracy grid as a PNG: depth (rows, 0 = the haystack's start) by length (columns)."""
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(result.lengths), 1.2 + 0.55 * len(result.depths)), dpi=100)
    grid = result.accuracy.T  # [depths, lengths]
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(result.lengths)), [length_name(n) for n in result.lengths])
    ax.set_yticks(range(len(result.depths)), [f"{d:g}" for d in result.depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for j in range(grid.shape[0]):
        for i in range(grid.shape[1]):
            ax.text(i, j, f"{grid[j, i]:.2f}\n{result.logprob[i, j]:.1f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title or f"retrieval probe, step {result.step}", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def png_to_rgb(png: bytes) -> np.ndarray:
    """[H, W, 3] uint8, as TensorBoard's add_image takes it (HWC)."""
    return (plt.imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(np.uint8)


def write_png(png: bytes, folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step}.png"
    path.write_bytes(png)
    return path


def publish(result: ProbeResult, tensorboard: Any, folder: Path | None, seconds: float) -> None:
    """The log table and the PNG (`folder`: this rank writes them; None: not this rank), and TensorBoard
    where `tensorboard` (a `RunTensorBoardLogger`, on the metrics rank) is given; `seconds`: the run's wall time."""
    if folder is None and tensorboard is None:
        return
    png = heatmap_png(result)
    if folder is not None:
        path = write_png(png, folder, result.step)
        logger.info(f"probe step {result.step}: accuracy {result.mean_accuracy:.3f} over the cells "
                    f"({result.tokens:,} tokens per probe run, {seconds:.1f} s; {path}); accuracy / log-prob of an answer "
                    f"token by depth and length:\n{table(result)}")  # fmt: skip
    if tensorboard is not None:
        tensorboard.log(scalars(result), result.step)  # opens the run's writer on first use
        tensorboard.writer.add_image("probe/heatmap", png_to_rgb(png), result.step, dataformats="HWC")
