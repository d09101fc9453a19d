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

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/grpo-train

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: install
	@$(BIN)/python -m pytest; status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests"; exit 1; fi; \
	exit $$status

test-fast: install
	$(BIN)/python -m pytest -m 'not slow'

clean:
	rm -rf $(VENV) .cache outputs multirun .pytest_cache
