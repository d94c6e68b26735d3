"""The executor's defaults and bounds a command line offers (``Executor(max_cycles=, lag=, launch_rounds=)``):
plain values in a module that imports nothing, so building ``run`` / ``bench`` / ``serve``'s flags loads no torch
(``serve``'s first HTTP front parses them and never runs the engine)."""

# Rounds one execute may run per owner group. Each execute boundary costs host work with nothing queued on
# the device (~0.5 ms on an H200's host), so more rounds per execute pay it less often; cancels, stop strings
# and queued requests that could join end an execute after its round (the serving loop's should_yield),
# so a larger cap delays none of them. benchmarks/RESULTS.md: 8 -> 32 rounds, H200, default pair.
DEFAULT_MAX_CYCLES = 32
MAX_LAG = 3  # launches a lane may keep queued beyond the one read (``lag``): each adds a ring entry per row
MAX_LAUNCH_ROUNDS = 8  # rounds one launch may run (``launch_rounds``): each is captured in every program's graph
# ``serve``'s rounds per launch where the engine runs on a CUDA device (1 elsewhere: on the CPU a launch computes
# before it returns, so rounds back to back save no host work and discard more at a request's end). Under load
# the serving thread bounds both modes and its work is per launch: on one H100 (benchmarks/RESULTS.md, "Four
# rounds per launch by default on CUDA") 4 against 1 gave DFlash +12% at 64 streams, +5% at 16, +-0 at one.
SERVE_CUDA_LAUNCH_ROUNDS = 4
