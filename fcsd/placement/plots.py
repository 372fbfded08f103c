"""Fig. 2 of the second paper as PNG: expert co-selection within a layer, ``P(e2 in top-k | e1 in top-k)``, and
across layers, ``P(e2 at l+1 | e1 at l)``, for one MoE layer of recorded routes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fcsd.placement.solver import coselection
from fcsd.placement.stats import transition_matrix
from fcsd.placement.traces import Routes


def within_layer_matrix(ids_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """``P(e2 in top-k | e1 in top-k)`` (rows e1)."""
    loads = np.bincount(ids_TK.ravel(), minlength=num_experts).astype(np.float64)
    w = coselection(ids_TK, num_experts).astype(np.float64)
    return np.divide(w, loads[:, None], out=np.zeros_like(w), where=loads[:, None] > 0)


def plot_heatmaps(routes: Routes, out_dir: str | Path, layer: int | None = None) -> list[Path]:
    """Write ``within_layer_<l>.png`` and ``across_layers_<l>_<l+1>.png`` for MoE layer ``layer`` (default: the
    middle one); strongly correlated cells (> 0.3) are outlined as in the paper's figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fcsd.files import ownership

    out_dir = Path(out_dir)
    ownership.mark(out_dir, "plots")
    layers = routes.layers
    layer = layers[len(layers) // 2 - (len(layers) % 2 == 0)] if layer is None else int(layer)
    e = routes.num_experts
    panels = [(within_layer_matrix(routes.layer(layer), e), f"within layer {layer}", f"within_layer_{layer}.png")]
    position = layers.index(layer)  # routes.layer above refused a layer the routes do not hold
    if position + 1 < len(layers):
        nxt = layers[position + 1]
        matrix = transition_matrix(routes.layer(layer), routes.layer(nxt), e)
        panels.append((matrix, f"across layers {layer} -> {nxt}", f"across_layers_{layer}_{nxt}.png"))
    written = []
    for matrix, title, name in panels:
        fig, ax = plt.subplots(figsize=(6, 5))
        image = ax.imshow(matrix, cmap="Reds", vmin=0, vmax=max(float(matrix.max()), 1e-9))
        strong = np.argwhere(matrix > 0.3)
        ax.scatter(strong[:, 1], strong[:, 0], s=6, c="tab:blue", marker="s", label="> 0.3")
        ax.set_xlabel("e2")
        ax.set_ylabel("e1")
        ax.set_title(f"{routes.header.get('model', '')}: {title}", fontsize=9)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        ownership.record(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
