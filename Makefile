# Two entry points, both self-contained on a fresh machine (Python 3.11, no GPU):
#   make demo   build the venv if needed, then chat with the embedded demo model
#   make test   build the venv if needed, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
IMAGE ?= $(VENV)/demo.png
# the demo model is trained on synthetic shapes questions; the picture has a red circle, a blue square, a green triangle
# (it answers this one right, also through the rules below; it is wrong about a quarter of colour questions and
# says "no" to every "Is there ...?")
QUESTION ?= What colour is the circle?
# Through our operators (optimize_rules/qwen3vl.yaml): experts of layers 0-1 pinned, of layers 2-3 in the host
# store behind a cache of 35 slabs (fetched, evicted), half the visual tokens pruned before the last layer.
# The pinned depth and prune layer are set: at the depth Eq. 10 picks for this budget (1 layer), pruning after
# that layer flips this answer; with these settings the held-out accuracy equals the stock modules' (BENCHMARKS.md).
RULES ?= optimize_rules/qwen3vl.yaml
RULE_SETTINGS ?= --set expert_budget=7MiB --set pinned_layers=2 --set prune_layer=3

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
	$(BIN)/vismmoe-kt chat --demo --optimize_config_path $(RULES) $(RULE_SETTINGS) --image $(IMAGE) \
		--prompt "$(QUESTION)" --greedy --max_new_tokens 8 --stats

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
