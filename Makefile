# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Test files run in three processes (pytest-xdist, a file's tests in one of them; all the Spark
# files in one, tests/conftest.py): most tests wait on real workers and servers, so on the
# 2-CPU CI machine three at once finish pytest in about 8 minutes where two took about 21
# (with the JVM settings of tests/conftest.py). The longest files go first (LONGEST_FIRST there).
TEST_PROCESSES ?= 3

.PHONY: demo test lint typecheck docs bench install clean chaos chaos-all chaos-smoke compare spark-cluster \
	celery-canvas dramatiq-suite matrix matrix-lowest

# The install is quiet: setuptools' note "Editable installation" (printed on every editable
# install of a package-dir layout such as this one, not a problem) is not shown.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(PY) -m pip install --quiet -e '.[all,sqs,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/taskonce demo

test: $(STAMP)
	.ci/services
	$(MAKE) lint typecheck docs
	$(PY) -m pytest -q -ra -n $(TEST_PROCESSES) --dist loadfile --durations=15 $(PYTEST_ARGS)

# The version matrix (tools/matrix.py): the suite's version-sensitive subset (the stores, a real
# worker per framework and broker, the Django project's workers, the audit) in fresh virtualenvs,
# every runtime dependency at its lowest admitted version, then at its newest. MATRIX_ARGS adds
# options (--python python3.12 for another interpreter). CI runs the lowest session after test.
matrix: $(STAMP)
	.ci/services
	$(PY) -m tools.matrix $(MATRIX_ARGS)

matrix-lowest: $(STAMP)
	.ci/services
	$(PY) -m tools.matrix --session lowest $(MATRIX_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check core celery_ext dramatiq_ext spark_ext demo

# mypy cannot see setuptools' package-dir mapping of an editable install: check a link tree
# that lays the folders out under their import names.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/taskonce
	for f in core/*; do ln -s ../../../$$f build/typecheck/taskonce/; done
	for d in celery_ext dramatiq_ext spark_ext demo django_ext; do ln -s ../../../$$d build/typecheck/taskonce/$$d; done
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p taskonce

# The documentation site (mkdocs.yml) into site/; --strict fails on a broken link, a missing
# anchor or an API reference that does not resolve. mkdocstrings reads the code from a link
# tree under its import names, as mypy does.
docs: $(STAMP)
	rm -rf build/docs-src && mkdir -p build/docs-src/taskonce
	for f in core/*; do ln -s ../../../$$f build/docs-src/taskonce/; done
	for d in celery_ext dramatiq_ext spark_ext demo django_ext; do ln -s ../../../$$d build/docs-src/taskonce/$$d; done
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The audit on a Spark standalone cluster (a master and two workers started by the test).
spark-cluster: $(STAMP)
	$(PY) -m pytest -q -ra -m spark_cluster tests/spark/test_standalone_cluster.py

bench: $(STAMP)
	$(PY) bench/store_ops.py

# The chaos soak (tools/soak): the long run of each framework, transactional PostgreSQL store;
# chaos-all runs every variant. CHAOS_ARGS adds options (e.g. --seconds 600 --messages 10000).
# The hand-off variant gets 1200 s to drain: its children double the bodies a long run leaves
# queued (docs/reliability.md). Dramatiq's hand-off variant publishes DRAMATIQ_HANDOFF_RATE
# messages a second (--rate wins over --messages): the rate its workers sustained on the
# 2-CPU machine of docs/reliability.md; measure yours with the report's bodies_per_s.
DRAMATIQ_HANDOFF_RATE ?= 1.5
chaos: $(STAMP)
	$(PY) -m tools.soak.soak --framework celery $(CHAOS_ARGS)
	$(PY) -m tools.soak.soak --framework dramatiq $(CHAOS_ARGS)

chaos-all: $(STAMP)
	status=0; for fw in celery dramatiq; do \
	  for v in "--store postgresql" "--store postgresql --mode lazy" "--store redis" \
	           "--store redis --mode lazy" "--store postgresql --handoff --drain-timeout 1200"; do \
	    rate=""; case "$$fw $$v" in "dramatiq "*--handoff*) rate="--rate $(DRAMATIQ_HANDOFF_RATE)";; esac; \
	    $(PY) -m tools.soak.soak --framework $$fw $$v $(CHAOS_ARGS) $$rate || status=1; \
	  done; \
	done; exit $$status

# The hand-off soak, short (about 2 minutes): both frameworks side by side, 300 messages over
# 30 s of faults; taskonce's receipts publish again the children the broker lost.
chaos-smoke: $(STAMP)
	status=0; \
	$(PY) -m tools.soak.soak --framework celery --handoff --seconds 30 --messages 300 $(CHAOS_ARGS) & celery=$$!; \
	$(PY) -m tools.soak.soak --framework dramatiq --handoff --seconds 30 --messages 300 $(CHAOS_ARGS) || status=1; \
	wait $$celery || status=1; exit $$status

# Side by side with celery-once, celery-singleton and Powertools' idempotency (bench/peers).
compare: $(STAMP)
	$(PY) -m pip install --quiet -r bench/peers/requirements.txt
	$(PY) -m bench.peers.compare $(COMPARE_ARGS)

# The frameworks' own test suites, without and with taskonce (tools/celery_canvas.py,
# tools/dramatiq_suite.py; CONTRIBUTING.md says how to get the sources). Not in .ci/run: the
# canvas tests take about 20 minutes on a busy 2-CPU machine. UPSTREAM_ARGS adds options (-k EXPR).
CELERY_SRC ?= ../celery
DRAMATIQ_SRC ?= ../dramatiq
celery-canvas: $(STAMP)
	$(PY) -m pip install --quiet -r tools/upstream/requirements.txt
	$(PY) -m tools.celery_canvas --celery-src $(CELERY_SRC) $(UPSTREAM_ARGS)

dramatiq-suite: $(STAMP)
	$(PY) -m tools.dramatiq_suite --dramatiq-src $(DRAMATIQ_SRC) $(UPSTREAM_ARGS)

clean:
	rm -rf $(VENV) build site .pytest_cache .mypy_cache .ruff_cache .hypothesis
