"""What users run: the command line (cli), chat, eval, calibrate, trace, serve/ (the HTTP server),
bench/ (`vismmoe-kt bench`) and measure/ (standalone measurements: `python -m vismmoe_kt.apps.measure.X`).
Apps may import anything; nothing imports apps."""
