# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench install clean spark-cluster

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/taskonce demo

test: $(STAMP)
	.ci/services
	$(MAKE) lint typecheck
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check core celery_ext dramatiq_ext spark_ext demo

# mypy cannot see setuptools' package-dir mapping of an editable install: check a link tree
# that lays the folders out under their import names.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/taskonce
	for f in core/*; do ln -s ../../../$$f build/typecheck/taskonce/; done
	for d in celery_ext dramatiq_ext spark_ext demo; do ln -s ../../../$$d build/typecheck/taskonce/$$d; done
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p taskonce

# The audit on a Spark standalone cluster (a master and two workers started by the test).
spark-cluster: $(STAMP)
	$(PY) -m pytest -q -ra -m spark_cluster tests/spark/test_standalone_cluster.py

bench: $(STAMP)
	$(PY) bench/store_ops.py

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis
