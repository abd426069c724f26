"""Result files: <name>.json (metadata and rows), <name>.md (a header and a Markdown table)
and <name>[suffix].png (plots), written by every benchmark into bench/results/h200/ (or --out).

A result file holds the rows of one run only: its header names the GPU, the versions, the
commit, the date and the ceilings measured in that run.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.timing import error_text

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "h200"
STUDIES_DIR = Path(__file__).resolve().parent / "studies" / "results"  # sweeps and one-off studies


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "as_dict"):  # a timing.Timing
    return _jsonable(x.as_dict())
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(float(x)) else None
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, (str, int, bool)) or x is None:
    return x
  return str(x)


def format_value(v, fmt=None) -> str:
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "–"
  if fmt is not None:
    return fmt(v) if callable(fmt) else fmt.format(v)
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, (int, np.integer)):
    return str(int(v))
  if isinstance(v, (float, np.floating)):
    a = abs(float(v))
    if a == 0:
      return "0"
    if a >= 100:
      return f"{v:.0f}"
    if a >= 10:
      return f"{v:.1f}"
    if a >= 0.01:
      return f"{v:.2f}"
    return f"{v:.2e}"
  return str(v)


def value_with_pct(row: dict, key: str, pct_key: str) -> str | None:
  """A cell such as "2183 (47%)": the value and its share of the ceiling."""
  value = row.get(key)
  if value is None:
    return None
  pct = row.get(pct_key)
  return format_value(value) + (f" ({pct:.0f}%)" if pct is not None else "")


def _normalize_columns(rows, columns):
  if columns is None:
    keys = []
    for r in rows:
      keys += [k for k, v in r.items() if k not in keys and not isinstance(v, (dict, list))]
    columns = keys
  out = []
  for c in columns:
    if isinstance(c, str):
      out.append((c, c, None))
    else:
      key, header, *fmt = c
      out.append((key, header, fmt[0] if fmt else None))
  return out


def markdown_table(rows: Sequence[dict], columns=None) -> str:
  """A Markdown table; columns: keys, or (key, header[, format string or callable]) where
  key may also be a callable of the row (a derived cell)."""
  cols = _normalize_columns(rows, columns)
  lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(format_value(k(r) if callable(k) else r.get(k), f)
                                   for k, _, f in cols) + " |")
  return "\n".join(lines)


def meta_lines(meta: dict) -> list[str]:
  """The header lines of a result file: GPU, versions, date and commit, ceilings, timing method."""
  v = meta.get("versions", {})
  lines = [f"- GPU: {meta.get('device')} (backend {meta.get('backend')}, {meta.get('sm_count')} SMs, "
           f"compute capability {meta.get('compute_capability')}, driver {meta.get('driver')})",
           "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           f"- Date (UTC): {meta.get('date')}"
           + (f", commit {meta['commit']}" if meta.get("commit") else "")]
  ceil = meta.get("ceilings") or {}
  if ceil:
    parts = []
    if "hbm_read_gbs" in ceil:
      parts.append(f"HBM read {format_value(ceil['hbm_read_gbs'])} GB/s (XLA sum over "
                   f"{format_value(ceil.get('hbm_read_bytes', 0) / 2**30)} GiB)")
    if "matmul_tflops" in ceil:
      parts.append(f"bf16 matmul {format_value(ceil['matmul_tflops'])} TFLOP/s "
                   f"({ceil.get('matmul_n')}³)")
    lines.append("- Ceilings measured in this run: " + "; ".join(parts))
  if meta.get("timing"):
    lines.append(f"- Timing: {meta['timing']}")
  for extra in meta.get("notes_header", []):
    lines.append(f"- {extra}")
  return lines


def _plot(path: Path, rows: Sequence[dict], spec: dict) -> None:
  """spec: x (key), y (key or list of keys), optional series (key: one line per value of it),
  labels {key or series value: label}, title, xlabel, ylabel, logx, logy, hline (value, label)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in rows if spec.get("where", lambda r: True)(r)]
  fig, ax = plt.subplots(figsize=spec.get("figsize", (7.5, 4.5)))
  labels = spec.get("labels", {})
  x = spec["x"]
  ys = spec["y"] if isinstance(spec["y"], (list, tuple)) else [spec["y"]]
  if spec.get("kind") == "bar":  # one bar per row: x is the row's label
    bars = [(str(r.get(x)), r.get(ys[0])) for r in rows if isinstance(r.get(ys[0]), (int, float))]
    if bars:
      ax.bar(range(len(bars)), [b for _, b in bars], color="tab:blue")
      ax.set_xticks(range(len(bars)), [a for a, _ in bars], rotation=90, fontsize=6)
    spec = {**spec, "logx": False}
  lines = []
  if spec.get("kind") == "bar":
    pass
  elif spec.get("series"):
    groups: dict = {}
    for r in rows:
      groups.setdefault(r.get(spec["series"]), []).append(r)
    for value, group in groups.items():
      lines.append((labels.get(value, str(value)), group, ys[0]))
  else:
    lines = [(labels.get(y, y), rows, y) for y in ys]
  for label, group, y in lines:
    pts = [(r.get(x), r.get(y)) for r in group]
    pts = [(a, b) for a, b in pts if isinstance(a, (int, float)) and isinstance(b, (int, float))
           and math.isfinite(b)]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  if spec.get("hline"):
    value, label = spec["hline"]
    if value:
      ax.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
  if spec.get("logx"):
    ax.set_xscale("log", base=2)
  if spec.get("logy"):
    ax.set_yscale("log")
  ax.set_xlabel(spec.get("xlabel", "" if spec.get("kind") == "bar" else x))
  ax.set_ylabel(spec.get("ylabel", ys[0] if len(ys) == 1 else ""))
  ax.set_title(spec.get("title", ""), fontsize=10)
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def earlier_rows(path, commit) -> tuple[list[dict], list[str]]:
  """(rows, notes) of the result file `path` for a run split over several calls (a script's
  --merge), or ([], []) where there is none. It must come from `commit`: one file holds one
  tree's rows."""
  path = Path(path)
  if not path.exists():
    return [], []
  earlier = json.loads(path.read_text())
  if earlier["meta"].get("commit") != commit:
    raise SystemExit(f"--merge: {path} is of commit {earlier['meta'].get('commit')}, this tree is "
                     f"{commit}; one file holds one commit's rows")
  return earlier["rows"], earlier.get("notes", [])


def write_results(name: str, rows: Sequence[dict], meta: dict, columns=None, plot=None, *,
                  out_dir=None, notes: Sequence[str] = (), extra: dict | None = None) -> dict:
  """Writes <out_dir>/<name>.json (meta, rows, extra), <name>.md (metadata header lines and
  a Markdown table of `columns`, then `notes`) and, with `plot` (a spec dict, see `_plot`, or
  a list of them, each with an optional "suffix"), <name>[suffix].png. Returns the paths."""
  out = Path(out_dir) if out_dir is not None else RESULTS_DIR
  out.mkdir(parents=True, exist_ok=True)
  paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
  payload = {"name": name, "meta": meta, "rows": list(rows), "notes": list(notes)}
  if extra:
    payload.update(extra)
  paths["json"].write_text(json.dumps(_jsonable(payload), indent=1) + "\n")
  md = [f"# {meta.get('title', name)}", "", *meta_lines(meta), "", markdown_table(rows, columns)]
  if notes:
    md += ["", *[f"- {n}" for n in notes]]
  paths["md"].write_text("\n".join(md) + "\n")
  specs = plot if isinstance(plot, (list, tuple)) else ([plot] if plot else [])
  for spec in specs:
    png = out / f"{name}{spec.get('suffix', '')}.png"
    try:
      _plot(png, rows, spec)
      paths.setdefault("png", []).append(png)
    except Exception as e:  # noqa: BLE001 -- a plot must never lose the numbers
      print(f"plot {png.name} failed: {error_text(e)}", file=sys.stderr, flush=True)
  return paths

