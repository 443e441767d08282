"""Peer libraries (FBGEMM, TorchRec) run in a venv of their own.

pallas_emb never imports torch: a comparison program starts a worker script
(`bench/*_worker.py`) with the python of a separate venv that has torch and
the peer, given by a flag or an environment variable. Without it, or when the
worker cannot import the peer, the peer's side is skipped with a one-line
message saying why and how to build one.
"""

from __future__ import annotations

import json
import os
import subprocess


def default_python(*env_names: str) -> str:
  """The first of these environment variables that is set ("" if none)."""
  return next((os.environ[n] for n in env_names if os.environ.get(n)), "")


def worker_env(threads: int = 0) -> dict:
  """The worker's environment: no XLA_FLAGS; `threads` > 0 caps OMP/MKL."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  if threads:
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
  return env


def probe(python: str, worker: str, args: list[str], *, skip: str,
          what: str, flag: str, env_names: tuple[str, ...], imports: str,
          hint: str, threads: int = 0) -> tuple[dict | None, str]:
  """(the worker's last JSON line, "") if `python worker args` runs, else
  (None, "`skip` why not; `hint`").

  what: the peer's name ("FBGEMM"); flag, env_names: where the python comes
  from; imports: what the worker imports ("torch / fbgemm_gpu").
  """
  if not python:
    return None, (f"{skip} no {what} python given ({flag}, or env "
                  f"{' / '.join(env_names)}); {hint}")
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    return None, (f"{skip} {flag}={python} is not an executable file; "
                  f"{hint}")
  try:
    proc = subprocess.run([python, worker, *args], capture_output=True,
                          text=True, timeout=300, check=False,
                          env=worker_env(threads))
  except (OSError, subprocess.TimeoutExpired) as e:
    return None, f"{skip} {python} failed to start the worker: {e}"
  if proc.returncode:
    tail = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    return None, (f"{skip} {python} cannot import {imports} ("
                  f"{tail[-1] if tail else 'exit ' + str(proc.returncode)})"
                  f"; {hint}")
  return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def git_head() -> str | None:
  """The repository's commit (+ '-dirty' if pallas_emb/ has changes)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "pallas_emb"],
                           cwd=root, capture_output=True, text=True,
                           timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("-dirty" if dirty else "")
