# splitfeed: `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test demo bench lint envtest e2e e2e-kind sync-crd clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# kube-apiserver, etcd, kubectl and helm for the control-plane tests; cached
# outside the checkout. Prints the assets directory on its last line.
envtest:
	@bash tests/envtest/build.sh

test: install
	KUBEBUILDER_ASSETS="$$(bash tests/envtest/build.sh | tail -n 1)" \
		$(PY) -m pytest $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) -m tests.bench.run

lint: install
	$(VENV)/bin/lint-imports
	$(PY) -c "import operator, collections"

clean:
	rm -rf $(VENV) .demo bench/results.json
