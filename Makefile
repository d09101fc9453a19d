# grpo-cli: two commands do all set-up on a fresh machine.
#   make demo   - create .venv, install, run `grpo-train` (the embedded tiny default, CPU)
#   make test   - same set-up if needed, then every test (slow runs included)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of PyTorch. On a CUDA machine install your CUDA torch into .venv first and
# run `make TORCH=torch demo` (an installed torch satisfies the unpinned requirement).
TORCH ?= torch==2.13.0

.PHONY: install lock demo test test-fast lint clean

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

# After moving a dependency on (and checking `make test` with it): write its versions down.
lock: install
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | \
	  grep -v -i -E '^(torch|grpo-cli)=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	touch $(STAMP)

demo: install
	$(BIN)/grpo-train

# Two pytest-xdist workers (the CI machines have 2 cores; tests/conftest.py gives each one math
# thread), tests spread one by one except those grouped to share a fixture (xdist_group).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: install
	@$(BIN)/python -m pytest $(XDIST); status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests"; exit 1; fi; \
	exit $$status

# ruff first (configured in pyproject.toml): a lint or format slip fails in seconds, before the tests.
lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

test-fast: lint
	$(BIN)/python -m pytest $(XDIST) -m 'not slow'

clean:
	rm -rf $(VENV) .cache outputs multirun .pytest_cache
