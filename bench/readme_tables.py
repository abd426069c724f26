"""The README's result tables, generated from the result JSONs of one suite run.

Each table sits in README.md between `<!-- table:NAME -->` and `<!-- /table:NAME -->`. The
tables are built from the JSONs named in TABLES; if those JSONs record different commits (or
none, or uncommitted changes) nothing is written: a README table quotes one tree.

  python -m bench.readme_tables [--results DIR] [--readme README.md] [--check]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

from bench.report import RESULTS_DIR, format_value, markdown_table, value_with_pct

README = Path(__file__).resolve().parents[1] / "README.md"


@dataclasses.dataclass(frozen=True)
class Table:
  """name: its README marker; source: the result file stem; rows(rows) -> the rows shown;
  columns: report.markdown_table's."""
  name: str
  source: str
  rows: Callable[[list], list]
  columns: Sequence


def _size(batch_key: str, n_key: str, k: bool = False):
  def cell(r):
    n = r.get(n_key)
    size = f"{n // 1024}K" if k and n and n % 1024 == 0 else f"{n}"
    return f"{r.get(batch_key)} × {size}"
  return cell


def _prefill_rows(rows):
  return [r for r in rows if r.get("n", 0) >= 2048]


def _best_peer_ratio(r):
  peers = [r.get(f"{p}_tflops") for p in ("fa3", "tokamax")]
  peers = [p for p in peers if isinstance(p, (int, float))]
  if not peers or not isinstance(r.get("jaxflash_tflops"), (int, float)):
    return None
  return r["jaxflash_tflops"] / max(peers)


def _ratio(a: str, b: str):
  def cell(r):
    x, y = r.get(a), r.get(b)
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None
  return cell


def _decode_rows(rows):
  keep = {(1, 4096), (1, 32768), (1, 131072), (16, 4096)}
  return [r for r in rows if (r.get("batch"), r.get("context")) in keep]


def _generate_rows(rows):
  """One row per (batch, prompt): the generate loop's ms a step of each attention."""
  out: dict = {}
  for r in rows:
    cell = out.setdefault((r["batch"], r["prompt"]), {"batch": r["batch"], "prompt": r["prompt"]})
    cell[r["impl"]] = r.get("loop_ms_step")
    if r["impl"] == "jaxflash paged":
      cell["over_floor"], cell["tokens_per_s"] = r.get("loop_over_floor"), r.get("tokens_per_s")
  return list(out.values())


def _accuracy_rows(rows):
  """Per output (out, LSE, dQ, dK, dV): the largest jaxflash / cuDNN (and / Triton) ratio over
  the cases, and the case it comes from."""
  out = []
  for which in ("out", "lse", "dq", "dk", "dv"):
    mine = [r for r in rows if r["which"] == which]
    worst = max(mine, key=lambda r: r.get("ratio") or 0.0, default=None)
    worst_t = max(mine, key=lambda r: r.get("ratio_triton") or 0.0, default=None)
    if worst is None:
      continue
    out.append({"which": which, "cases": len(mine), "ratio": worst.get("ratio"),
                "case": f"{worst['case']} n={worst['n']} d={worst['d']}" if worst.get("ratio") else None,
                "ratio_triton": worst_t.get("ratio_triton")})
  return out


TABLES = (
    Table("prefill", "prefill", _prefill_rows, [
        (_size("batch", "n"), "B × n"),
        (lambda r: value_with_pct(r, "jaxflash_tflops", "jaxflash_pct"), "jaxflash (default)"),
        ("jaxflash_triton_tflops", "jaxflash Triton"), ("cudnn_tflops", "cuDNN"), ("fa3_tflops", "FA3"),
        ("tokamax_tflops", "tokamax"), ("pallas_mha_tflops", "JAX Pallas `mha`"),
        (_ratio("jaxflash_tflops", "cudnn_tflops"), "÷ cuDNN", "{:.2f}"),
        (_best_peer_ratio, "÷ best of FA3, tokamax", "{:.2f}")]),
    Table("decode", "decode", _decode_rows, [
        (_size("batch", "context", k=True), "B × context"),
        (lambda r: value_with_pct(r, "jaxflash_gbs", "jaxflash_pct"), "jaxflash"),
        (lambda r: value_with_pct(r, "jaxflash_paged16_gbs", "jaxflash_paged16_pct"), "paged, pages of 16"),
        ("cudnn_gbs", "cuDNN"), ("pallas_gqa_gbs", "JAX Pallas `gqa`"),
        (_ratio("jaxflash_gbs", "cudnn_gbs"), "jaxflash / cuDNN", "{:.2f}")]),
    Table("generate", "generate", _generate_rows, [
        (_size("batch", "prompt", k=True), "B × prompt"), ("jaxflash paged", "jaxflash"),
        ("cudnn", "cuDNN"), ("xla", "xla"), ("hf", "HF transformers"),
        ("over_floor", "jaxflash / floor", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.0f}")]),
    Table("accuracy", "accuracy", _accuracy_rows, [
        ("which", "which"), ("cases", "cases"), ("ratio", "largest jaxflash / cuDNN error", "{:.2f}"),
        ("case", "on"), ("ratio_triton", "largest jaxflash / Triton error", "{:.2f}")]),
)


class NotOneRun(ValueError):
  """The JSONs a README table needs are missing or come from different trees."""


def load(results_dir, tables=TABLES) -> dict[str, dict]:
  """{source: its JSON}, refusing JSONs of different, unrecorded or uncommitted trees."""
  paths = {t.source: Path(results_dir) / f"{t.source}.json" for t in tables}
  missing = [str(p) for p in paths.values() if not p.exists()]
  if missing:
    raise NotOneRun(f"missing result files {missing}; run `python -m bench` first")
  data = {source: json.loads(path.read_text()) for source, path in paths.items()}
  commits = {source: d.get("meta", {}).get("commit") for source, d in data.items()}
  unusable = {s: c for s, c in commits.items() if not c or "+" in c}
  if unusable or len(set(commits.values())) != 1:
    raise NotOneRun("the README's tables must come from one run of one commit; the results "
                       "record " + ", ".join(f"{s}: {c or 'no commit'}" for s, c in commits.items())
                       + ". Run `python -m bench` on a clean checkout first.")
  return data


def render(results_dir, tables=TABLES) -> dict[str, str]:
  """{table name: its Markdown, with a line naming the run}."""
  data = load(results_dir, tables)
  out = {}
  for t in tables:
    meta = data[t.source]["meta"]
    source = f"[{t.source}.md](bench/results/h200/{t.source}.md)"
    out[t.name] = (markdown_table(t.rows(data[t.source]["rows"]), t.columns) + "\n\n"
                   f"<sub>{source}: {meta.get('device')}, {format_value(meta.get('date'))[:10]}, "
                   f"commit {meta.get('commit')}</sub>")
  return out


def fill(readme_text: str, tables: dict[str, str]) -> str:
  """readme_text with each marked table replaced; a marker pair missing is an error."""
  for name, body in tables.items():
    pattern = re.compile(rf"(<!-- table:{name} -->\n).*?(\n<!-- /table:{name} -->)", re.S)
    if not pattern.search(readme_text):
      raise ValueError(f"README has no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
    readme_text = pattern.sub(lambda m: m.group(1) + body + m.group(2), readme_text)
  return readme_text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--results", default=str(RESULTS_DIR))
  p.add_argument("--readme", default=str(README))
  p.add_argument("--check", action="store_true", help="exit 1 if the README's tables differ, write nothing")
  args = p.parse_args(argv)
  try:
    tables = render(args.results)
  except NotOneRun as e:
    print(f"readme_tables: {e}", file=sys.stderr)
    return 2
  readme = Path(args.readme)
  text = readme.read_text()
  new = fill(text, tables)
  if args.check:
    return 0 if new == text else 1
  readme.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main())
