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

# The suite runs in TEST_WORKERS pytest processes side by side (pytest-xdist, tests handed
# out as workers free up), each through tests/isolate.sh: a network namespace of its own, so
# that two never share the test kubelet's pod ports or /etc/hosts names. The end-to-end tests
# mostly wait on the processes they start (~40% of 2 cores busy), so two workers on 2 cores
# take about 0.6 of the time of one. One worker where no namespace can be made.
TEST_WORKERS ?= $(shell bash tests/isolate.sh --check && echo 2 || echo 1)
WORKER := env -u SPLITFEED_ISOLATED bash tests/isolate.sh $(PY)
test: install
	KUBEBUILDER_ASSETS="$$(bash tests/envtest/build.sh | tail -n 1)" \
		$(PY) -m pytest --dist worksteal --tx "$(TEST_WORKERS)*popen//python=$(WORKER)" \
		--durations=25 $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) -m tests.bench.run

# import-linter cannot follow the editable install's finder: pkg/splitfeed is a committed
# view of the four folders as splitfeed.* (symlinks), which mypy and editors use too.
lint: install
	PYTHONPATH=pkg $(VENV)/bin/lint-imports
	MYPYPATH=pkg $(PY) -m mypy --config-file pyproject.toml -p splitfeed
	$(PY) -c "import operator, collections"
	$(PY) crds/sync.py --check

sync-crd: install
	$(PY) crds/sync.py

e2e: install
	KUBEBUILDER_ASSETS="$$(bash tests/envtest/build.sh | tail -n 1)" \
		$(PY) -m pytest --dist worksteal --tx "$(TEST_WORKERS)*popen//python=$(WORKER)" \
		-m e2e tests/e2e $(PYTEST_ARGS)

# Real pods in a kind cluster; needs Docker. Not part of `make test`.
e2e-kind: install
	bash tests/e2e/kind.sh

clean:
	rm -rf $(VENV) .demo bench/results.json
