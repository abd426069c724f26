"""jaxflash's benchmarks, run as modules from the repository root (python -m bench.prefill).

trace (profiler trace -> kernel events), timing (device time per call), ceilings (HBM read,
bf16 matmul), environment (GPU, versions, commit, date), report (result files), cli (options,
time limit, a run's start); the scripts: prefill, decode, generate, generate_tp, profile_step.
"""
