"""jaxflash's benchmarks, run from the repository root: `python -m bench` (the suite of
bench/suite.py) or one script as a module (`python -m bench.prefill`).

runner (a benchmark's run: options, time limit, result files), suite (benchmarks x shapes x
providers), index (the results index), readme_tables (the README's tables), trace (profiler
trace -> kernel events), timing (device time per call), ceilings (HBM read, bf16 matmul),
environment (GPU, versions, commit, date), report (result files), cli (shared options); the
scripts: accuracy, prefill, windowed, train, decode, paged_prefill, generate, serve,
generate_tp; sweeps and one-off studies in bench/studies/.
"""
