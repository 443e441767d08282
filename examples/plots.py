"""Plots of a run into a PNG: the rating models' train and eval MSE
curves; the sequence model's training loss per epoch and validation
metrics."""

from __future__ import annotations

import os


def _pyplot():
  """matplotlib.pyplot (drawing to files), or None when not installed."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return plt


def _missing(path: str) -> str:
  return (f"matplotlib is not installed, so no plot was written to {path} "
          "(pip install matplotlib).")


def _save(fig, plt, path: str) -> str:
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return f"wrote {path}"


def plot_curves(path: str, metrics: dict) -> str:
  """Draws the train/eval MSE curves into `path`; returns a status line."""
  plt = _pyplot()
  if plt is None:
    return _missing(path)
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
  return _save(fig, plt, path)


def plot_seqrec(path: str, metrics: dict) -> str:
  """Draws each seed's training loss per epoch and its validation HR@10 /
  NDCG@10 wherever it evaluated (examples/seqrec's metrics) into `path`;
  returns a status line."""
  plt = _pyplot()
  if plt is None:
    return _missing(path)
  fig, (loss_ax, valid_ax) = plt.subplots(1, 2, figsize=(11, 4))
  for k, run in enumerate(metrics.get("runs") or [metrics]):
    seed, color = run["seed"], f"C{k}"  # a color per seed
    losses = run["epoch_losses"]
    loss_ax.plot(range(1, len(losses) + 1), losses, color=color,
                 label=f"seed {seed}")
    epochs = [point["epoch"] for point in run["curve"]]
    for key, style in (("hr@10", "o-"), ("ndcg@10", "s--")):
      valid_ax.plot(epochs, [point[f"valid_{key}"] for point in run["curve"]],
                    style, color=color, label=f"{key.upper()}, seed {seed}")
  loss_ax.set_xlabel("epoch")
  loss_ax.set_ylabel("sampled softmax loss")
  loss_ax.set_title(f"{metrics['model']} on {metrics['dataset']}: training "
                    "loss")
  valid_ax.set_xlabel("epoch")
  trained_on = metrics["config"].get("train_on_valid")
  valid_ax.set_title(f"validation, {metrics['items']:,} items ranked"
                     + (" (item trained on)" if trained_on else ""))
  for ax in (loss_ax, valid_ax):
    ax.legend(fontsize="small")
  return _save(fig, plt, path)
