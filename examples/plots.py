"""Plots of a run: the train and eval MSE curves, into a PNG."""

from __future__ import annotations

import os


def plot_curves(path: str, metrics: dict) -> str:
  """Draws the train/eval MSE curves into `path`; returns a status line."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return (f"matplotlib is not installed, so no plot was written to {path} "
            "(pip install matplotlib).")
  fig, ax = plt.subplots(figsize=(6, 4))
  eval_name = metrics.get("eval_set", "test")
  for name in ("train", eval_name):
    points = metrics[f"{name}_curve"]
    ax.plot([p["step"] for p in points], [p[f"{name}_mse"] for p in points],
            marker="." if name != "train" else None, label=f"{name} MSE")
  if metrics.get("label_floor") is not None:
    ax.axhline(metrics["label_floor"], color="gray", ls=":",
               label="noise floor")
  ax.set_xlabel("step")
  ax.set_ylabel("MSE")
  title = f"{metrics['dataset']}: {eval_name} RMSE " \
      f"{metrics[f'{eval_name}_rmse']:.4f}"
  if metrics.get("model", "BiasedMF") != "BiasedMF":
    title += f" ({metrics['model']})"
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return f"wrote {path}"
