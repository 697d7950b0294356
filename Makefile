# Two entry points (see README): `make demo` and `make test`. Both create ./.venv on first
# use. torch is pinned to the CPU build available on our CI machines; on a CUDA machine,
# install your own torch first and use `pip install --no-build-isolation -e .` directly.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
NPROC  ?= 2
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fusedist-installed
NATIVE := $(wildcard csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*/*.cuh)

.PHONY: demo test bench install clean

# lightning: the optional Lightning strategy (fusedist[lightning]) is tested too; torchao: its
# float8 training weights are tested with fully_shard (FSDP2's all-gather extension).
DEPS   := numpy "triton>=3.0" pytest hypothesis pybind11 ninja "setuptools>=64" wheel "lightning>=2.4" \
          "torchao==0.18.0"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-run when the dependency list changes, so an existing .venv picks up new ones.
$(STAMP): $(BIN)/python Makefile setup.py pyproject.toml $(NATIVE)
	$(BIN)/pip install -q "$(TORCH)" $(DEPS)
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(STAMP)

# Every rank and every launched script is a fresh interpreter that imports fusedist's sources.
# Where PYTHONDONTWRITEBYTECODE is set none of them writes the
# bytecode it compiles, so each would compile it all again; compiled once here, they read it
# (Python checks each file's timestamp, so an edited source is still compiled afresh).
BYTECODE := $(BIN)/python -m compileall -q -j 0 fusedist triton_kernels tests examples benchmarks > /dev/null

demo: $(STAMP)
	@$(BYTECODE)
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_gpt.py $(ARGS)

test: $(STAMP)
	@$(BYTECODE)
	$(BIN)/pytest tests $(ARGS)

bench: $(STAMP)
	@$(BYTECODE)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf build *.egg-info fusedist/*.so
