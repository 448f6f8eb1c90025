"""The measurements whose numbers go to BENCHMARKS.md, beside the package (nothing in `vismmoe_kt`
imports them; they may import any of it):

    bench/      `python -m benchmarks.bench`: every configuration side by side, same run, same inputs
    models/     full-size random-weight models (in host memory, or written as a GGUF checkpoint)
    results/    the raw results, one folder per date
    NAME.py     a standalone measurement: `python -m benchmarks.NAME --help`
"""
