"""Standalone measurements whose numbers go to BENCHMARKS.md, each run as
`python -m vismmoe_kt.apps.measure.NAME --help`."""
