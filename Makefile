# Two entry points, both self-contained on a fresh machine (Python 3.11, no GPU):
#   make demo   build the venv if needed, then chat with the embedded demo model
#   make test   build the venv if needed, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
IMAGE ?= $(VENV)/demo.png
# the demo model is trained on synthetic shapes questions; the picture has a red circle, a blue square, a green triangle
# (it answers this one right; it is wrong about a quarter of colour questions and says "no" to every "Is there ...?")
QUESTION ?= What colour is the circle?

.PHONY: demo test venv clean

venv: $(STAMP)

# torch is installed first and pinned to the CPU wheel: an unpinned torch would pull a CUDA build.
# kt-kernel (the CPU MoE kernels) pins an old torch in its metadata but does not link libtorch: no deps.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps kt-kernel==0.7.2 gguf==0.19.0 triton==3.6.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m vismmoe_kt.demo.pictures $(IMAGE)
	$(BIN)/vismmoe-kt chat --demo --image $(IMAGE) --prompt "$(QUESTION)" --greedy --max_new_tokens 8 --stats

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
