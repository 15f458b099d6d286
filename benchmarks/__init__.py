"""Side-by-side performance measurements of vitcam_nb (issue #11): ``python -m benchmarks [--quick]``.

Modules: :mod:`benchmarks.suite` (the run, targets and merging), :mod:`benchmarks.items` (one module per measured
item), :mod:`benchmarks.timing` (interleaved timing, medians, paired ratios), :mod:`benchmarks.machine` (machine and
versions), :mod:`benchmarks.peers` (plain PyTorch, pytorch-grad-cam and torchcam, used at their best),
:mod:`benchmarks.workloads` (models and inputs), :mod:`benchmarks.memprobe` (peak memory in a fresh process),
:mod:`benchmarks.report` (markdown).
"""
