"""What users run: the command line (cli), chat, eval, calibrate, trace and serve/ (the HTTP server).
Apps may import anything in the package; nothing in it imports apps. The measurements live beside the
package, in `benchmarks/`."""
