"""Sweeps and one-off studies, apart from the benchmark suite: the Mosaic prefill's tile and
schedule sweep (mosaic_sweep), decode with options (decode_options), clocks and power under load
(power), one decode step's kernels (profile_step). Each runs as `python -m bench.studies.<name>`
and writes into bench/studies/results/ (with the sweep logs the kernels' comments cite)."""
