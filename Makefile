# Two commands on a fresh machine: `make run` (install + default simulation), `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
NUM_CLIENTS ?= 10
# pytest-xdist workers for `make test`: much of the suite waits on engine processes (pyproject.toml)
TEST_WORKERS ?= 2
RUN_CONFIG ?=

.PHONY: install data run test lint bench clean

install: $(STAMP) data

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "flowerbed needs Python >= 3.11 (flwr does)"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch/torchvision first, pinned: this machine serves these builds from local disk.
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The Debian package with the full Fashion-MNIST (offline default data set), when apt exists.
data:
	@if [ -f $(FMNIST) ]; then exit 0; fi; \
	if command -v apt-get >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist; \
	else echo "apt-get not found: Fashion-MNIST will be downloaded by torchvision (needs network)"; fi

run: install
	$(VENV)/bin/flowerbed run --num-clients $(NUM_CLIENTS) $(if $(RUN_CONFIG),--run-config "$(RUN_CONFIG)")

test: install
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(VENV)/bin/ruff check flowerbed tests benchmarks

clean:
	rm -rf $(VENV) .flwr-home runs
